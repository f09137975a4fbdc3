//! `pgfence doctor` through the binary: exit codes, one line per finding, `--json`, and a
//! database failover reported until it is acknowledged.

use crate::common::BIN;
use crate::common::test_db::{pgfence, stdout};
use crate::support;

use std::process::{Command, Stdio};

use support::TestDb;

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
