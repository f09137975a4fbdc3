//! `pgfence doctor` and the guard modes through the binary: exit codes, one line per
//! finding, `--json`.

use crate::support;

use std::process::{Command, Output, Stdio};

use support::{TestDb, redis_url};

const BIN: &str = env!("CARGO_BIN_EXE_pgfence");

async fn pgfence(db: &TestDb, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("DATABASE_URL", db.url())
        .env("REDIS_URL", redis_url().await)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("run pgfence")
}

fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).unwrap()
}

#[tokio::test]
async fn doctor_exit_codes_lines_and_json() {
    let db = TestDb::empty().await;
    // Not migrated: a finding, exit 1, one line for it plus the summary.
    let out = pgfence(&db, &["doctor"]).await;
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(
        lines[0].starts_with("error") && lines[0].contains("schema_not_migrated"),
        "{text}"
    );
    assert!(lines[0].contains("pgfence migrate"), "{text}");

    pgfence::admin::migrate(&db.pool).await.unwrap();
    db.exec(
        "CREATE TABLE jobs (id int PRIMARY KEY, state text); INSERT INTO jobs VALUES (1, 'new')",
    )
    .await;
    let out = pgfence(&db, &["guard", "jobs"]).await;
    assert!(out.status.success(), "{out:?}");

    // Healthy: exit 0.
    let out = pgfence(&db, &["doctor", "--audit-retention", "30d"]).await;
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(stdout(&out).contains("ok: no problems found"));
    let out = pgfence(&db, &["doctor", "--json"]).await;
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let v: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(v["ok"], true);

    // A disabled trigger and an old audit row: exit 1, both in the JSON.
    db.exec("ALTER TABLE jobs DISABLE TRIGGER pgfence_guard;
             INSERT INTO pgfence.audit (at, presented, operation) VALUES (now() - interval '40 days', 1, 'check')")
        .await;
    let out = pgfence(&db, &["doctor", "--json", "--audit-retention", "30d"]).await;
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let v: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(v["ok"], false);
    assert_eq!(v["problems"], 2);
    let kinds: Vec<&str> = v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["severity"] != "info")
        .map(|f| f["kind"].as_str().unwrap())
        .collect();
    assert!(
        kinds.contains(&"trigger_disabled") && kinds.contains(&"audit_retention"),
        "{v}"
    );
    let disabled = v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["kind"] == "trigger_disabled")
        .unwrap();
    assert_eq!(disabled["object"], "\"public\".\"jobs\"");
    assert_eq!(disabled["severity"], "error");
    assert!(
        disabled["suggestion"]
            .as_str()
            .unwrap()
            .contains("ENABLE TRIGGER")
    );

    // Human output: one line per finding, then the summary.
    let out = pgfence(&db, &["doctor", "--audit-retention", "30d", "--no-scan"]).await;
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("error") || l.starts_with("warning"))
            .count(),
        2,
        "{text}"
    );
    assert_eq!(text.lines().last(), Some("2 problem(s) found"), "{text}");

    // An unreachable Redis is a finding, not a crash; --no-redis skips it.
    let out = Command::new(BIN)
        .args(["doctor", "--redis-url", "redis://127.0.0.1:1"])
        .env("DATABASE_URL", db.url())
        .env_remove("REDIS_URL")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).contains("redis_unavailable"), "{out:?}");

    // Bad arguments are usage errors (exit 2), a database that cannot be reached exit 1.
    let out = pgfence(&db, &["doctor", "--audit-retention", "soon"]).await;
    assert_eq!(out.status.code(), Some(2));
    let out = Command::new(BIN)
        .args([
            "doctor",
            "--database-url",
            "postgres://postgres@127.0.0.1:1/x",
        ])
        .env_remove("REDIS_URL")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("pgfence: "));
}

#[tokio::test]
async fn guard_observe_enforce_and_tables_show_the_mode() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE jobs (id int PRIMARY KEY, state text); INSERT INTO jobs VALUES (1, 'new')",
    )
    .await;
    let out = pgfence(&db, &["guard", "--observe", "jobs"]).await;
    assert!(out.status.success(), "{out:?}");
    assert!(stdout(&out).contains("(observe)"));
    let out = pgfence(&db, &["tables"]).await;
    assert_eq!(stdout(&out), "\"public\".\"jobs\"\tobserve\n");
    let out = pgfence(&db, &["tables", "--json"]).await;
    let v: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(
        v,
        serde_json::json!([{"schema": "public", "table": "jobs", "mode": "observe", "enabled": true}])
    );
    // Observing: a raw update passes and shows in the audit trail.
    sqlx::query("UPDATE jobs SET state = 'done'")
        .execute(&db.pool)
        .await
        .unwrap();
    let out = pgfence(&db, &["audit", "--json"]).await;
    assert!(stdout(&out).contains("\"observe\""), "{out:?}");

    let out = pgfence(&db, &["guard", "--enforce", "jobs"]).await;
    assert!(out.status.success(), "{out:?}");
    assert!(stdout(&out).starts_with("guarded"));
    assert!(
        sqlx::query("UPDATE jobs SET state = 'again'")
            .execute(&db.pool)
            .await
            .is_err()
    );
    let out = pgfence(&db, &["tables"]).await;
    assert_eq!(stdout(&out), "\"public\".\"jobs\"\tenforce\n");
    // Plain guard enforces: nothing to change now.
    let out = pgfence(&db, &["guard", "jobs"]).await;
    assert!(
        stdout(&out).contains("already guarded (enforce)"),
        "{out:?}"
    );
    // The two flags exclude each other.
    let out = pgfence(&db, &["guard", "--observe", "--enforce", "jobs"]).await;
    assert_eq!(out.status.code(), Some(2));

    // The emitted migration carries the mode.
    let dir = std::env::temp_dir().join(format!("pgfence-observe-{}", rand::random::<u32>()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = pgfence(
        &db,
        &[
            "guard",
            "--observe",
            "jobs",
            "--emit-migration",
            dir.to_str().unwrap(),
        ],
    )
    .await;
    assert!(out.status.success(), "{out:?}");
    let sql = std::fs::read_to_string(dir.join("V1__guard_jobs.sql")).unwrap();
    assert!(sql.contains("'observe'"), "{sql}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A promotion as the timeline history shows it (the real failover is in the library's
/// `postgres pg_failover::`): doctor exits non-zero with a `failed_over` finding until
/// `--ack-failover`, which needs the owner and is recorded with who acknowledged.
#[tokio::test]
async fn doctor_reports_a_failover_until_it_is_acknowledged() {
    let db = TestDb::new().await;
    let out = pgfence(&db, &["doctor", "--no-redis"]).await;
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    // The history of a database promoted from the timeline before this one.
    db.exec(
        "DELETE FROM pgfence.timeline_history;
         INSERT INTO pgfence.timeline_history (timeline, acknowledged_at, acknowledged_by)
         VALUES (pgfence.timeline() - 1, now(), 'installed');",
    )
    .await;
    let out = pgfence(&db, &["doctor", "--no-redis"]).await;
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let text = stdout(&out);
    assert!(
        text.contains("failed_over") && text.contains("--ack-failover"),
        "{text}"
    );
    let out = pgfence(&db, &["doctor", "--no-redis", "--json"]).await;
    let v: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(v["ok"], false);
    assert!(
        v["findings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f["kind"] == "failed_over" && f["severity"] == "error"),
        "{v}"
    );

    let out = pgfence(&db, &["doctor", "--no-redis", "--ack-failover"]).await;
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("acknowledged 1 failover"),
        "{out:?}"
    );
    let by: Option<String> = sqlx::query_scalar(
        "SELECT acknowledged_by FROM pgfence.timeline_history WHERE timeline = pgfence.timeline()",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        by.is_some_and(|b| b.starts_with("pgfence doctor --ack-failover")),
        "recorded who acknowledged"
    );
    let out = pgfence(&db, &["doctor", "--no-redis"]).await;
    assert_eq!(out.status.code(), Some(0), "{out:?}");
}
