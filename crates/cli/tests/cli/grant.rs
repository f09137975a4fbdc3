//! `pgfence grant`: an application role gets the privileges it needs at run time.

use crate::common::text;
use crate::common::urls::{one_error, pgfence};
use crate::support;

use support::{TestDb, redis_url};

/// `pgfence grant ROLE` gives an application role what it needs and says what it granted;
/// the schema's owner is refused.
#[tokio::test]
async fn grant_gives_an_application_role_its_privileges() {
    let db = TestDb::new().await;
    let redis = redis_url().await;
    let role = format!("pgfence_app_{}", rand::random::<u32>());
    db.exec(&format!("CREATE ROLE {role}")).await;
    let out = pgfence(&db.url(), &redis, &["grant", &role.to_uppercase()]);
    let stdout = text(&out.stdout);
    let dropped = format!("DROP OWNED BY {role}; DROP ROLE {role}");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        stdout.contains(&format!("granted \"{role}\""))
            && stdout.contains("GRANT USAGE ON SCHEMA pgfence"),
        "{stdout}"
    );
    let can: (bool, bool) = sqlx::query_as(
        "SELECT has_schema_privilege($1, 'pgfence', 'USAGE'),
                has_function_privilege($1, 'pgfence.check(text, bigint, integer)', 'EXECUTE')",
    )
    .bind(&role)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    db.exec(&dropped).await;
    assert_eq!(can, (true, true));
    let owner: String = sqlx::query_scalar(
        "SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'pgfence'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let err = one_error(&pgfence(
        &db.url(),
        &redis,
        &["grant", &format!("\"{owner}\"")],
    ));
    assert!(err.contains("owns the pgfence schema"), "{err}");
    let err = one_error(&pgfence(&db.url(), &redis, &["grant", "no_such_role_xyz"]));
    assert!(err.contains("does not exist"), "{err}");
}

/// `--idle-in-transaction-timeout` sets the role's default in this database (what a paused
/// worker's transaction is bounded by), says so, and `0s` removes it.
#[tokio::test]
async fn grant_sets_and_removes_the_roles_idle_transaction_bound() {
    let db = TestDb::new().await;
    let redis = redis_url().await;
    let role = format!("pgfence_app_{}", rand::random::<u32>());
    db.exec(&format!("CREATE ROLE {role}")).await;
    let setting = || async {
        sqlx::query_scalar::<_, Vec<String>>(
            "SELECT s.setconfig FROM pg_db_role_setting s JOIN pg_roles r ON r.oid = s.setrole \
             JOIN pg_database d ON d.oid = s.setdatabase \
             WHERE r.rolname = $1 AND d.datname = current_database()",
        )
        .bind(&role)
        .fetch_optional(&db.pool)
        .await
        .unwrap()
    };
    let out = pgfence(
        &db.url(),
        &redis,
        &["grant", &role, "--idle-in-transaction-timeout", "45s"],
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(stdout.contains("end after 45000 ms idle"), "{stdout}");
    assert_eq!(
        setting().await,
        Some(vec!["idle_in_transaction_session_timeout=45000".to_owned()])
    );
    let out = pgfence(
        &db.url(),
        &redis,
        &["grant", &role, "--idle-in-transaction-timeout", "0s"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("removed"),
        "{}",
        text(&out.stdout)
    );
    assert_eq!(setting().await, None);
    db.exec(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
        .await;
}
