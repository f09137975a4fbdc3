//! Rolling the guard out: observe mode (report-only), switching to enforce, and the audited
//! bypass for maintenance by an allowed role.

use crate::support;

use pgfence::{Error, guard::GuardMode, table::TableName};
use sqlx::{Connection, PgConnection};
use support::TestDb;

fn accounts() -> TableName {
    TableName::parse("accounts").unwrap()
}

async fn setup() -> TestDb {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL);
         INSERT INTO accounts VALUES (1, 0), (2, 0);",
    )
    .await;
    db
}

/// A throwaway login-less role with SELECT/UPDATE on `accounts`; dropped by [`Role::drop`].
struct Role {
    name: String,
}

impl Role {
    async fn new(db: &TestDb, prefix: &str) -> Self {
        let name = format!("pgfence_{prefix}_{:08x}", rand::random::<u32>());
        db.exec(&format!(
            "CREATE ROLE {name}; GRANT SELECT, UPDATE ON accounts TO {name};
         GRANT USAGE ON SCHEMA pgfence TO {name};
         GRANT EXECUTE ON FUNCTION pgfence.bypass(text) TO {name};"
        ))
        .await;
        Self { name }
    }

    async fn drop(self, db: &TestDb) {
        db.exec(&format!("DROP OWNED BY {0}; DROP ROLE {0};", self.name))
            .await;
    }
}

/// A connection as `role` (SET ROLE), with `application_name` set.
async fn connect_as(db: &TestDb, role: &Role, app: &str) -> PgConnection {
    let mut conn = PgConnection::connect_with(&db.options.clone().application_name(app))
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("SET ROLE {}", role.name)))
        .execute(&mut conn)
        .await
        .unwrap();
    conn
}

#[derive(Debug, sqlx::FromRow, PartialEq, Eq)]
struct AuditRow {
    operation: String,
    holder: Option<String>,
    application_name: Option<String>,
    table_name: Option<String>,
    row_key: Option<String>,
    reason: Option<String>,
    db_user: Option<String>,
}

async fn audit_rows(db: &TestDb) -> Vec<AuditRow> {
    sqlx::query_as(
        "SELECT operation, holder, application_name, table_name, row_key, reason, db_user
           FROM pgfence.audit ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

async fn balance(db: &TestDb, id: i32) -> (i32, i64) {
    sqlx::query_as("SELECT balance, fence FROM accounts WHERE id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn observe_lets_an_unfenced_update_through_and_audits_who_wrote() {
    let db = setup().await;
    assert!(
        pgfence::guard::guard_with(&db.pool, &accounts(), GuardMode::Observe)
            .await
            .unwrap()
    );
    assert_eq!(
        pgfence::guard::guard_mode(&db.pool, &accounts())
            .await
            .unwrap(),
        Some(GuardMode::Observe)
    );
    let app = Role::new(&db, "app").await;
    let mut conn = connect_as(&db, &app, "refund-tool").await;
    let done = sqlx::query("UPDATE accounts SET balance = balance + 100 WHERE id = 1")
        .execute(&mut conn)
        .await
        .expect("observe mode lets the write through");
    assert_eq!(done.rows_affected(), 1);
    conn.close().await.unwrap();
    assert_eq!(
        balance(&db, 1).await,
        (100, pgfence::token::StoredFence::SEALED_SEQUENCE),
        "let through and sealed against every earlier lease"
    );

    let rows = audit_rows(&db).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(
        rows[0],
        AuditRow {
            operation: "observe".into(),
            holder: Some(app.name.clone()),
            application_name: Some("refund-tool".into()),
            table_name: Some("\"public\".\"accounts\"".into()),
            row_key: Some("[1]".into()),
            reason: None,
            db_user: rows[0].db_user.clone(),
        }
    );
    assert!(rows[0].db_user.is_some(), "the login role is recorded too");
    // The audit trail lists it like a rejection.
    let listed = pgfence::audit::list(&db.pool, &pgfence::audit::AuditFilter::default())
        .await
        .unwrap();
    assert_eq!(listed[0].operation, "observe");

    // An advancing write does not touch the trigger, so it is not audited.
    sqlx::query(
        "UPDATE accounts SET balance = 1, fence = pgfence.next_fence(fence, 3, 0) WHERE id = 2",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(audit_rows(&db).await.len(), 1);
    app.drop(&db).await;
}

#[tokio::test]
async fn enforce_rejects_and_modes_switch_both_ways() {
    let db = setup().await;
    assert!(pgfence::guard::guard(&db.pool, &accounts()).await.unwrap());
    assert_eq!(
        pgfence::guard::guard_mode(&db.pool, &accounts())
            .await
            .unwrap(),
        Some(GuardMode::Enforce),
        "plain guard enforces"
    );
    let raw = "UPDATE accounts SET balance = balance + 1 WHERE id = 1";
    let err = Error::from(sqlx::query(raw).execute(&db.pool).await.unwrap_err());
    assert!(matches!(err, Error::LeaselessWrite { .. }), "{err:?}");

    // To observe: the trigger is replaced, the same write passes and is audited.
    assert!(
        pgfence::guard::guard_with(&db.pool, &accounts(), GuardMode::Observe)
            .await
            .unwrap()
    );
    assert!(
        !pgfence::guard::guard_with(&db.pool, &accounts(), GuardMode::Observe)
            .await
            .unwrap(),
        "already observing"
    );
    sqlx::query(raw).execute(&db.pool).await.unwrap();
    assert_eq!(support::audit_count(&db.pool).await, 1);
    let listed = pgfence::guard::guarded_tables_with_modes(&db.pool)
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (listed[0].mode, listed[0].enabled),
        (GuardMode::Observe, true)
    );
    assert_eq!(listed[0].table, accounts());
    assert_eq!(
        pgfence::guard::guarded_tables(&db.pool).await.unwrap(),
        vec![accounts()]
    );

    // Back to enforcing, explicitly and through plain guard.
    assert!(
        pgfence::guard::guard_with(&db.pool, &accounts(), GuardMode::Enforce)
            .await
            .unwrap()
    );
    assert!(sqlx::query(raw).execute(&db.pool).await.is_err());
    pgfence::guard::guard_with(&db.pool, &accounts(), GuardMode::Observe)
        .await
        .unwrap();
    assert!(pgfence::guard::guard(&db.pool, &accounts()).await.unwrap());
    assert_eq!(
        pgfence::guard::guard_mode(&db.pool, &accounts())
            .await
            .unwrap(),
        Some(GuardMode::Enforce)
    );
    assert!(sqlx::query(raw).execute(&db.pool).await.is_err());
    assert_eq!(balance(&db, 1).await.0, 1, "only the observed write landed");

    // Exactly one trigger, and the repository's SQL still works: an advancing write passes.
    let triggers: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_trigger WHERE tgname = 'pgfence_guard'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(triggers, 1);
    sqlx::query(
        "UPDATE accounts SET balance = 7, fence = pgfence.next_fence(fence, 1, 0) WHERE id = 1",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        pgfence::guard::guard_mode(&db.pool, &TableName::parse("nope").unwrap())
            .await
            .unwrap(),
        None
    );
}

#[tokio::test]
async fn observe_mode_sql_can_be_emitted() {
    let sql = pgfence::guard::guard_migration_sql_with(&accounts(), GuardMode::Observe).unwrap();
    assert!(
        sql.contains("SELECT pgfence.guard('public', 'accounts', 'observe');"),
        "{sql}"
    );
    let db = setup().await;
    db.exec(&sql).await;
    assert_eq!(
        pgfence::guard::guard_mode(&db.pool, &accounts())
            .await
            .unwrap(),
        Some(GuardMode::Observe)
    );
}

#[tokio::test]
async fn bypass_by_an_allowed_role_is_audited_and_seals_the_row() {
    let db = setup().await;
    pgfence::guard::guard(&db.pool, &accounts()).await.unwrap();
    // A lease (token 5) wrote row 1.
    sqlx::query("UPDATE accounts SET fence = pgfence.next_fence(fence, 5, 0) WHERE id = 1")
        .execute(&db.pool)
        .await
        .unwrap();
    let admin = Role::new(&db, "admin").await;
    let other = Role::new(&db, "other").await;
    assert!(
        pgfence::guard::allow_bypass(&db.pool, &admin.name)
            .await
            .unwrap()
    );
    assert!(
        !pgfence::guard::allow_bypass(&db.pool, &admin.name)
            .await
            .unwrap()
    );

    let mut conn = connect_as(&db, &admin, "admin-console").await;
    let mut tx = conn.begin().await.unwrap();
    pgfence::guard::bypass(&mut tx, "refund #123")
        .await
        .unwrap();
    sqlx::query("UPDATE accounts SET balance = balance + 100 WHERE id = 1")
        .execute(&mut *tx)
        .await
        .expect("an allowed role may bypass");
    tx.commit().await.unwrap();
    // Only inside that transaction: the next plain update is rejected again (a lease-less
    // write that does not touch the fence).
    let err = sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE id = 1")
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert_eq!(
        err.as_database_error().unwrap().code().as_deref(),
        Some("PF007")
    );
    conn.close().await.unwrap();

    let (bal, fence) = balance(&db, 1).await;
    assert_eq!(bal, 100);
    assert_eq!(fence >> 24, 5, "still token 5's row");
    let rows = audit_rows(&db).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].operation, "bypass");
    assert_eq!(rows[0].holder.as_deref(), Some(admin.name.as_str()));
    assert_eq!(rows[0].reason.as_deref(), Some("refund #123"));
    assert_eq!(rows[0].application_name.as_deref(), Some("admin-console"));
    assert_eq!(rows[0].row_key.as_deref(), Some("[1]"));

    // Sealed: the lease that wrote the row before the refund cannot overwrite it (it must
    // take a new lease and re-read); a newer lease can.
    let err = sqlx::query(
        "UPDATE accounts SET balance = 0, fence = pgfence.next_fence(fence, 5, 0) WHERE id = 1",
    )
    .execute(&db.pool)
    .await
    .unwrap_err();
    assert_eq!(
        err.as_database_error().unwrap().code().as_deref(),
        Some("PF005"),
        "{err}"
    );
    sqlx::query("UPDATE accounts SET balance = balance + 1, fence = pgfence.next_fence(fence, 6, 0) WHERE id = 1")
        .execute(&db.pool)
        .await
        .unwrap();

    // Another role: refused, saying who and why; nothing audited or written.
    let mut conn = connect_as(&db, &other, "sneaky").await;
    let mut tx = conn.begin().await.unwrap();
    pgfence::guard::bypass(&mut tx, "just because")
        .await
        .unwrap();
    let err = sqlx::query("UPDATE accounts SET balance = 0 WHERE id = 2")
        .execute(&mut *tx)
        .await
        .unwrap_err();
    let db_err = err.as_database_error().unwrap();
    assert_eq!(db_err.code().as_deref(), Some("PF006"));
    assert!(
        db_err.message().contains("may not bypass") && db_err.message().contains(&other.name),
        "{}",
        db_err.message()
    );
    match Error::from(err) {
        Error::BypassRefused {
            table,
            role,
            reason,
            why,
        } => {
            assert_eq!(table, "\"public\".\"accounts\"");
            assert_eq!(role, other.name);
            assert_eq!(reason, "just because");
            assert!(why.contains("may not bypass"), "{why}");
        }
        e => panic!("a refused bypass is its own error, got {e:?}"),
    }
    drop(tx);
    conn.close().await.unwrap();

    // Superusers get no free pass either (the tests run as one).
    let mut tx = db.pool.begin().await.unwrap();
    pgfence::guard::bypass(&mut tx, "superuser").await.unwrap();
    assert!(
        sqlx::query("UPDATE accounts SET balance = 0 WHERE id = 2")
            .execute(&mut *tx)
            .await
            .is_err()
    );
    drop(tx);

    // Disallowed again: the admin is rejected too.
    assert!(
        pgfence::guard::disallow_bypass(&db.pool, &admin.name)
            .await
            .unwrap()
    );
    let mut conn = connect_as(&db, &admin, "admin-console").await;
    let mut tx = conn.begin().await.unwrap();
    let err = pgfence::guard::bypass(&mut tx, "refund #124")
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("permission denied"),
        "disallow_bypass took pgfence.bypass back: {err}"
    );
    drop(tx);
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("SET LOCAL pgfence.bypass = 'refund #124'")
        .execute(&mut *tx)
        .await
        .unwrap();
    assert!(
        sqlx::query("UPDATE accounts SET balance = 0 WHERE id = 2")
            .execute(&mut *tx)
            .await
            .is_err()
    );
    drop(tx);
    conn.close().await.unwrap();
    assert_eq!(audit_rows(&db).await.len(), 1);
    assert_eq!(balance(&db, 2).await.0, 0);

    // Unknown roles are refused.
    let err = pgfence::guard::allow_bypass(&db.pool, "pgfence_no_such_role_x")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("does not exist"), "{err}");
    admin.drop(&db).await;
    other.drop(&db).await;
}

#[tokio::test]
async fn observe_mode_records_a_refused_bypass_but_lets_the_write_through() {
    let db = setup().await;
    pgfence::guard::guard_with(&db.pool, &accounts(), GuardMode::Observe)
        .await
        .unwrap();
    let other = Role::new(&db, "other").await;
    let mut conn = connect_as(&db, &other, "tool").await;
    let mut tx = conn.begin().await.unwrap();
    pgfence::guard::bypass(&mut tx, "fix").await.unwrap();
    sqlx::query("UPDATE accounts SET balance = 5 WHERE id = 2")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    conn.close().await.unwrap();
    let rows = audit_rows(&db).await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].operation, "observe");
    assert!(
        rows[0].reason.as_deref().unwrap_or("").contains("refused"),
        "{rows:?}"
    );
    other.drop(&db).await;
}
