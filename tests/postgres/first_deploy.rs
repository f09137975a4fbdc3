//! A first deploy says what to do: `migrate` as a role that may not create pgfence's schema,
//! deploy-time calls made as the application role, and an emitted guard migration that runs
//! (through the service's own refinery) before `pgfence migrate`.

use crate::support;

use pgfence::{Error, error::ErrorKind, guard::GuardMode, table::TableName};
use refinery_core::traits::r#async::{AsyncQuery, AsyncTransaction};
use refinery_core::{AsyncMigrate, Migration, Runner};
use sqlx::{AssertSqlSafe, Connection, PgConnection, Row};
use support::{Role, TestDb};

#[tokio::test]
async fn migrate_as_a_role_that_may_not_create_the_schema_says_who_runs_it() {
    let db = TestDb::empty().await;
    let app = Role::create(&db, "firstapp", "").await;
    let pool = app.pool(&db).await;
    let err = pgfence::admin::migrate(&pool).await.unwrap_err();
    match &err {
        Error::MigrationNotPermitted {
            role,
            applied: 0,
            installed: false,
            ..
        } => assert_eq!(role, &app.name),
        other => panic!("{other:?}"),
    }
    assert_eq!(err.kind(), ErrorKind::Setup);
    let text = err.to_string();
    assert!(text.contains("pgfence migrate"), "{text}");
    assert!(text.contains(&app.name), "{text}");
    assert!(text.contains("not installed"), "{text}");
    assert!(!text.contains(" at line "), "{text}");
    // Nothing was created.
    let schema: Option<String> =
        sqlx::query_scalar("SELECT nspname::text FROM pg_namespace WHERE nspname = 'pgfence'")
            .fetch_optional(&db.pool)
            .await
            .unwrap();
    assert_eq!(schema, None);
    // The owner's run works; before its grant the role is told to get one, after it the
    // role's run is a no-op.
    pgfence::admin::migrate(&db.pool).await.unwrap();
    let err = pgfence::admin::migrate(&pool).await.unwrap_err();
    assert!(
        err.to_string()
            .contains(&format!("`pgfence grant {}`", app.name)),
        "{err}"
    );
    pgfence::admin::grant(&db.pool, &app.ident()).await.unwrap();
    assert!(pgfence::admin::migrate(&pool).await.unwrap().is_empty());
}

#[tokio::test]
async fn deploy_time_calls_as_the_app_role_name_the_call_and_who_runs_it() {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE ledger (id bigint PRIMARY KEY, amount int NOT NULL)")
        .await;
    let app = Role::create(&db, "deployapp", "").await;
    pgfence::admin::grant(&db.pool, &app.ident()).await.unwrap();
    db.exec(&format!(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON ledger TO {}",
        app.quoted()
    ))
    .await;
    let pool = app.pool(&db).await;
    let ledger = TableName::parse("ledger").unwrap();

    let check = |err: Error, command: &str| {
        assert!(matches!(err, Error::NotPermitted { .. }), "{err:?}");
        assert_eq!(err.kind(), ErrorKind::Setup);
        let text = err.to_string();
        assert!(text.contains(command), "{text}");
        assert!(text.contains("deploy-time"), "{text}");
        assert!(text.contains("owner"), "{text}");
    };
    check(
        pgfence::guard::guard(&pool, &ledger).await.unwrap_err(),
        "pgfence guard",
    );
    check(
        pgfence::guard::guard_with(&pool, &ledger, GuardMode::Observe)
            .await
            .unwrap_err(),
        "pgfence guard",
    );
    check(
        pgfence::guard::allow_bypass(&pool, &app.name)
            .await
            .unwrap_err(),
        "allow_bypass",
    );
    // A GRANT by a role without the right only warns in PostgreSQL: refused before it runs.
    let other = Role::create(&db, "otherapp", "").await;
    check(
        pgfence::admin::grant(&pool, &other.ident())
            .await
            .unwrap_err(),
        "pgfence grant",
    );
    check(
        pgfence::audit::prune(&pool, time::OffsetDateTime::now_utc())
            .await
            .unwrap_err(),
        "pgfence audit prune",
    );
    check(
        pgfence::admin::acknowledge_failover(&pool, "app")
            .await
            .unwrap_err(),
        "--ack-failover",
    );
    // Nothing changed: the table is not guarded.
    assert_eq!(
        pgfence::guard::guard_mode(&db.pool, &ledger).await.unwrap(),
        None
    );
    pgfence::guard::guard(&db.pool, &ledger).await.unwrap();
    check(
        pgfence::guard::unguard(&pool, &ledger, false)
            .await
            .unwrap_err(),
        "pgfence unguard",
    );
}

/// A service's own refinery migrations on sqlx, as a user would wire them: each migration
/// in a transaction.
struct ServiceMigrations<'c>(&'c mut PgConnection);

impl AsyncTransaction for ServiceMigrations<'_> {
    type Error = sqlx::Error;

    async fn execute<'a, T: Iterator<Item = &'a str> + Send + 'a>(
        &'a mut self,
        queries: T,
    ) -> Result<usize, Self::Error> {
        let mut tx = Connection::begin(&mut *self.0).await?;
        let mut count = 0;
        for query in queries {
            sqlx::raw_sql(AssertSqlSafe(query.to_owned()))
                .execute(&mut *tx)
                .await?;
            count += 1;
        }
        tx.commit().await?;
        Ok(count)
    }
}

impl AsyncQuery<Vec<Migration>> for ServiceMigrations<'_> {
    async fn query<'a>(&'a mut self, query: &'a str) -> Result<Vec<Migration>, Self::Error> {
        let rows = sqlx::query(AssertSqlSafe(query.to_owned()))
            .fetch_all(&mut *self.0)
            .await?;
        rows.iter()
            .map(|row| {
                let applied_on: String = row.try_get(2)?;
                let checksum: String = row.try_get(3)?;
                Ok(Migration::applied(
                    row.try_get(0)?,
                    row.try_get(1)?,
                    time::OffsetDateTime::parse(
                        &applied_on,
                        &time::format_description::well_known::Rfc3339,
                    )
                    .map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
                    checksum
                        .parse::<u64>()
                        .map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
                ))
            })
            .collect()
    }
}

impl AsyncMigrate for ServiceMigrations<'_> {}

#[tokio::test]
async fn an_emitted_guard_migration_before_pgfence_migrate_says_to_run_it_first() {
    let db = TestDb::empty().await;
    let ledger = TableName::parse("ledger").unwrap();
    let migrations = vec![
        Migration::unapplied(
            "V1__ledger",
            "CREATE TABLE ledger (id bigint PRIMARY KEY, amount int NOT NULL);",
        )
        .unwrap(),
        Migration::unapplied(
            "V2__guard_ledger",
            &pgfence::guard::guard_migration_sql(&ledger).unwrap(),
        )
        .unwrap(),
    ];
    let mut conn = db.pool.acquire().await.unwrap();
    let err = Runner::new(&migrations)
        .run_async(&mut ServiceMigrations(&mut conn))
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("run `pgfence migrate`"), "{text}");
    assert!(
        !text.contains("schema \"pgfence\" does not exist"),
        "{text}"
    );

    // After `pgfence migrate`, the same migrations apply; the table is guarded.
    pgfence::admin::migrate(&db.pool).await.unwrap();
    Runner::new(&migrations)
        .run_async(&mut ServiceMigrations(&mut conn))
        .await
        .unwrap();
    assert_eq!(
        pgfence::guard::guard_mode(&db.pool, &ledger).await.unwrap(),
        Some(GuardMode::Enforce)
    );
}
