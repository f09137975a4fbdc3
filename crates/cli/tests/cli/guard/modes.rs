//! The guard modes (observe, enforce) as `tables` and `doctor --json` show them.

use crate::common::test_db::{pgfence, stdout};
use crate::support;

use support::TestDb;

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
            "--migration-format",
            "refinery",
        ],
    )
    .await;
    assert!(out.status.success(), "{out:?}");
    let sql = std::fs::read_to_string(dir.join("V1__guard_jobs.sql")).unwrap();
    assert!(sql.contains("'observe'"), "{sql}");
    std::fs::remove_dir_all(dir).unwrap();
}
