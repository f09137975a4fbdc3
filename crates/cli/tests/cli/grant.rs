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
