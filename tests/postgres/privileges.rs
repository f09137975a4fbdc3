//! Least privilege: a non-superuser application role, set up by `pgfence::admin::grant`, can do
//! everything the library does (checks, repository writes, audit rows for its rejections)
//! and nothing that weakens fencing (lower a mark, change or delete audit rows, unguard).
//! Also: migrations under a hostile search_path, `pgfence.try_check`, and recovery from a
//! poisoned mark.

use crate::support;

use std::collections::BTreeSet;

use pgfence::{
    Error, Fence, Fencing, Repository, Resource,
    repository::Upserted,
    table::{Ident, TableName},
};
use sqlx::{Connection, PgConnection, PgPool};
use support::{Role, TestDb, token};

#[derive(Debug, Clone)]
struct Acct {
    id: i32,
    balance: i64,
}

pgfence::fenced_table!(Acct { table: "acct", key: id: i32, columns: [balance] });

fn acct(id: i32, balance: i64) -> Acct {
    Acct { id, balance }
}

/// The SQLSTATE of a failed statement.
#[track_caller]
fn sqlstate<T: std::fmt::Debug>(outcome: Result<T, sqlx::Error>) -> String {
    match outcome {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(sqlx::Error::Database(e)) => e.code().map(|c| c.into_owned()).unwrap_or_default(),
        Err(e) => panic!("expected a database error, got {e:?}"),
    }
}

/// A migrated database (owned by the test's superuser), a guarded table owned by that
/// superuser, and an application role with DML on the table and `pgfence::admin::grant`'s privileges.
async fn with_app() -> (TestDb, Role, PgPool) {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE acct (id int PRIMARY KEY, balance bigint NOT NULL);
         INSERT INTO acct VALUES (1, 100), (2, 200);",
    )
    .await;
    pgfence::guard::guard(&db.pool, &TableName::parse("acct").unwrap())
        .await
        .unwrap();
    let app = Role::create(&db, "pgfence_app", "NOSUPERUSER NOCREATEDB NOCREATEROLE").await;
    db.exec(&format!(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON acct TO {}",
        app.quoted()
    ))
    .await;
    pgfence::admin::grant(&db.pool, &app.ident()).await.unwrap();
    let pool = app.pool(&db).await;
    (db, app, pool)
}

type AuditRow = (String, i64, Option<i64>, Option<String>, Option<String>);

/// `(resource, presented, current, holder)` of an `unpoison` audit row.
type UnpoisonRow = (Option<String>, i64, Option<i64>, Option<String>);

/// `(operation, presented, current, holder, db_user)` of every audit row, oldest first.
async fn audit_rows(db: &TestDb) -> Vec<AuditRow> {
    sqlx::query_as(
        "SELECT operation, presented, current, holder, db_user FROM pgfence.audit ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// Everything the library does, as a non-superuser application role: checks (and their
/// audit rows, written by the auditor's pool), high-water marks, every repository write on a
/// pool and in a transaction (audit rows written by the rejecting statement and by the
/// auditor), tombstones, `next_fence` and `try_check` from SQL.
#[tokio::test]
async fn an_app_role_can_do_everything_the_library_does() {
    let (db, app, pool) = with_app().await;
    let is_super: bool =
        sqlx::query_scalar("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(!is_super);

    // The transaction-scope check, its rejection and its audit row (auditor's INSERT).
    let fence = Fence::new(pool.clone());
    let res = Resource::new("priv:check").unwrap();
    let mut tx = pool.begin().await.unwrap();
    fence.check(&mut *tx, &res, token(5)).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    let err = fence.check(&mut *tx, &res, token(4)).await.unwrap_err();
    support::assert_stale(&err, 4, 5);
    tx.rollback().await.unwrap();
    assert_eq!(fence.high_water(&res).await.unwrap(), 5);
    let domain = Resource::in_domain("privdom", "a").unwrap();
    fence.check(&pool, &domain, token(7)).await.unwrap();
    let other = Resource::in_domain("privdom", "b").unwrap();
    assert_eq!(
        pgfence::admin::counter_floor(&pool, &other).await.unwrap(),
        7
    );

    // Repository writes on a pool: applied, stale (audit row from the explaining statement).
    let repo = Repository::<Acct>::new(pool.clone()).unwrap();
    let lease = Fencing::new(token(10)).holder("job-10");
    repo.update(&pool, lease.clone(), &acct(1, 110))
        .await
        .unwrap();
    repo.update(&pool, lease.clone(), &acct(1, 111))
        .await
        .unwrap();
    let err = repo
        .update(&pool, Fencing::new(token(9)).holder("job-9"), &acct(1, 90))
        .await
        .unwrap_err();
    support::assert_stale(&err, 9, 10);
    let claimed: (i32,) = repo.claim(&pool, token(11), &2).await.unwrap();
    assert_eq!(claimed.0, 2);

    // In a transaction: the rejection's audit row goes through the auditor's pool.
    let mut tx = pool.begin().await.unwrap();
    let err = repo
        .update(&mut *tx, token(8), &acct(2, 80))
        .await
        .unwrap_err();
    support::assert_stale(&err, 8, 11);
    tx.rollback().await.unwrap();

    // Upsert, fenced delete (tombstone), and a stale upsert that must not resurrect the row.
    assert_eq!(
        repo.upsert(&pool, token(12), &acct(3, 300)).await.unwrap(),
        Upserted::Inserted
    );
    assert_eq!(
        repo.upsert(&pool, token(12), &acct(3, 301)).await.unwrap(),
        Upserted::Updated
    );
    repo.delete(&pool, token(13), &3).await.unwrap();
    let err = repo
        .upsert(&pool, token(12), &acct(3, 302))
        .await
        .unwrap_err();
    support::assert_stale(&err, 12, 13);
    // A newer lease deletes again over the tombstone (ON CONFLICT DO UPDATE raises it).
    repo.upsert(&pool, token(14), &acct(3, 303)).await.unwrap();
    repo.delete(&pool, token(15), &3).await.unwrap();
    let tomb: i64 = sqlx::query_scalar("SELECT fence >> 24 FROM pgfence.tombstone")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(tomb, 15);

    // Raw SQL under a lease, as `pgfence run` scripts write.
    sqlx::query(
        "UPDATE acct SET balance = 500, fence = pgfence.next_fence(fence, 20, 3) WHERE id = 1",
    )
    .execute(&pool)
    .await
    .unwrap();
    let state = sqlstate(
        sqlx::query(
            "UPDATE acct SET balance = 400, fence = pgfence.next_fence(fence, 19, 3) WHERE id = 1",
        )
        .execute(&pool)
        .await,
    );
    assert_eq!(state, "PF001");

    // try_check: true, then false with an audit row naming the role.
    let ok: bool = sqlx::query_scalar("SELECT pgfence.try_check('priv:sql', 30, 1)")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(ok);
    let ok: bool = sqlx::query_scalar("SELECT pgfence.try_check('priv:sql', 29, 1)")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(!ok);

    let who = Some(app.name.clone());
    assert_eq!(
        audit_rows(&db).await,
        vec![
            ("check".into(), 4, Some(5), None, who.clone()),
            (
                "update".into(),
                9,
                Some(10),
                Some("job-9".into()),
                who.clone()
            ),
            ("update".into(), 8, Some(11), None, who.clone()),
            ("upsert".into(), 12, Some(13), None, who.clone()),
            ("check".into(), 29, Some(30), who.clone(), who.clone()),
        ]
    );
    let rows: Vec<(i32, i64)> = sqlx::query_as("SELECT id, balance FROM acct ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(rows, vec![(1, 500), (2, 200)]);
    pool.close().await;
}

/// What an application role cannot do: lower a resource mark, a row fence or a tombstone;
/// read, change or delete audit rows (or forge their time or database user); guard, unguard,
/// unpoison, or disable the guard trigger; write pgfence's tables directly.
#[tokio::test]
async fn an_app_role_cannot_lower_marks_touch_audit_rows_or_unguard() {
    let (db, _app, pool) = with_app().await;
    let fence = Fence::new(pool.clone());
    let res = Resource::new("priv:deny").unwrap();
    fence.check(&pool, &res, token(50)).await.unwrap();
    let repo = Repository::<Acct>::new(pool.clone()).unwrap();
    repo.update(&pool, token(50), &acct(1, 150)).await.unwrap();
    repo.delete(&pool, token(50), &2).await.unwrap();
    sqlx::query(
        "INSERT INTO pgfence.audit (resource, presented, operation) VALUES ('x', 1, 'check')",
    )
    .execute(&pool)
    .await
    .expect("appending an audit row is allowed (the auditor does it)");

    let denied = [
        // Marks.
        "UPDATE pgfence.resource_fence SET fence = 1",
        "DELETE FROM pgfence.resource_fence",
        "INSERT INTO pgfence.resource_fence (resource, fence) VALUES ('priv:new', 1)",
        "SELECT fence FROM pgfence.resource_fence",
        "TRUNCATE pgfence.resource_fence",
        "SELECT pgfence.unpoison_resource('priv:deny', 1)",
        // Tombstones: no delete; a lowering update is refused by the tombstone trigger.
        "DELETE FROM pgfence.tombstone",
        "TRUNCATE pgfence.tombstone",
        "UPDATE pgfence.tombstone SET fence = 1",
        "UPDATE pgfence.tombstone SET row_key = '[7]'",
        // Audit rows.
        "DELETE FROM pgfence.audit",
        "UPDATE pgfence.audit SET presented = 0",
        "TRUNCATE pgfence.audit",
        "SELECT count(*) FROM pgfence.audit",
        "INSERT INTO pgfence.audit (at, presented, operation) VALUES (now() - interval '1 year', 1, 'check')",
        "INSERT INTO pgfence.audit (db_user, presented, operation) VALUES ('someone_else', 1, 'check')",
        // Guarding.
        "SELECT pgfence.unguard('public', 'acct')",
        "SELECT pgfence.unguard('public', 'acct', true)",
        "SELECT pgfence.guard('public', 'acct')",
        "ALTER TABLE acct DISABLE TRIGGER pgfence_guard",
        "DROP TRIGGER pgfence_guard ON acct",
        "ALTER TABLE acct DROP COLUMN fence",
        "SELECT * FROM pgfence.guarded_tables",
        "SELECT * FROM pgfence.refinery_schema_history",
        "CREATE TABLE pgfence.mine (x int)",
        "CREATE FUNCTION pgfence.check(text) RETURNS void LANGUAGE sql AS 'SELECT'",
    ];
    for sql in denied {
        let state = sqlstate(sqlx::query(sql).execute(&pool).await);
        assert_eq!(state, "42501", "{sql}");
    }
    // Lowering through the functions or the guarded table is a stale token.
    let err = fence.check(&pool, &res, token(49)).await.unwrap_err();
    support::assert_stale(&err, 49, 50);
    let state = sqlstate(
        sqlx::query("UPDATE acct SET fence = 0 WHERE id = 1")
            .execute(&pool)
            .await,
    );
    assert_eq!(state, "PF001");

    // Nothing moved.
    assert_eq!(
        pgfence::admin::high_water(&db.pool, &res).await.unwrap(),
        50
    );
    let tomb: i64 = sqlx::query_scalar("SELECT fence >> 24 FROM pgfence.tombstone")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(tomb, 50);
    let guarded = pgfence::guard::guarded_tables(&db.pool).await.unwrap();
    assert_eq!(guarded, vec![TableName::parse("acct").unwrap()]);
    let fence_of_1: i64 = sqlx::query_scalar("SELECT fence >> 24 FROM acct WHERE id = 1")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(fence_of_1, 50);
    // The forged-looking row the app may append, and the check rejection: nothing deleted.
    assert_eq!(support::audit_count(&db.pool).await, 2);
    pool.close().await;
}

/// `grant_sql` quotes any role name, and `grant` gives exactly the documented privileges:
/// it revokes anything else the role had, and refuses the owner of pgfence's schema.
#[tokio::test]
async fn grant_gives_exactly_the_documented_privileges() {
    let db = TestDb::new().await;
    let app = Role::create(&db, "pgfence \"app\"; DROP ROLE postgres; --", "").await;
    // Extra privileges from an earlier, careless setup: grant must take them away.
    db.exec(&format!(
        "GRANT USAGE ON SCHEMA pgfence TO {r};
         GRANT ALL ON ALL TABLES IN SCHEMA pgfence TO {r};
         GRANT EXECUTE ON FUNCTION pgfence.unguard(text, text, boolean) TO {r};",
        r = app.quoted()
    ))
    .await;
    let sql = pgfence::admin::grant_sql(&app.ident());
    assert!(sql.contains(&format!("TO {};", app.quoted())), "{sql}");
    // Applying twice is the same as once.
    db.exec(&sql).await;
    pgfence::admin::grant(&db.pool, &app.ident()).await.unwrap();

    let tables: BTreeSet<String> = sqlx::query_scalar(
        "SELECT c.relname || ':' || a.privilege_type
           FROM pg_class c, aclexplode(c.relacl) a
          WHERE c.relnamespace = 'pgfence'::regnamespace AND a.grantee = $1::regrole",
    )
    .bind(app.quoted())
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    assert_eq!(tables, set(&["tombstone:INSERT", "tombstone:SELECT"]));

    let columns: BTreeSet<String> = sqlx::query_scalar(
        "SELECT c.relname || '.' || att.attname || ':' || a.privilege_type
           FROM pg_attribute att JOIN pg_class c ON c.oid = att.attrelid, aclexplode(att.attacl) a
          WHERE c.relnamespace = 'pgfence'::regnamespace AND a.grantee = $1::regrole",
    )
    .bind(app.quoted())
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    assert_eq!(
        columns,
        set(&[
            "audit.current:INSERT",
            "audit.holder:INSERT",
            "audit.operation:INSERT",
            "audit.other_counter:INSERT",
            "audit.presented:INSERT",
            "audit.resource:INSERT",
            "audit.row_key:INSERT",
            "audit.table_name:INSERT",
            "tombstone.deleted_at:UPDATE",
            "tombstone.fence:UPDATE",
        ])
    );

    // Functions the role can execute (directly or through PUBLIC), and which run with the
    // owner's rights.
    let functions: Vec<(String, bool)> = sqlx::query_as(
        "SELECT p.proname::text, p.prosecdef FROM pg_proc p
          WHERE p.pronamespace = 'pgfence'::regnamespace
            AND has_function_privilege($1::regrole, p.oid, 'EXECUTE')
          ORDER BY 1",
    )
    .bind(app.quoted())
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let expected: Vec<(String, bool)> = [
        // The shell path's functions and next_fence / lease_fence run with the owner's rights:
        // they call internal functions (the fence layout's helpers among them), which no
        // application role may execute.
        ("admits", true),
        ("admits", true),
        ("append_audit", true),
        ("append_audit", true),
        ("bypass", false),
        ("check", true),
        ("check", true),
        ("check_on", true),
        ("domain_high_water", true),
        ("domain_mark_holder", true),
        ("effect_begin", true),
        ("effect_finish", true),
        ("effect_status", true),
        ("high_water", true),
        ("issuer_acquire", true),
        ("issuer_expire_idle", true),
        ("issuer_extend", true),
        ("issuer_release", true),
        ("issuer_state", true),
        ("issuer_status", true),
        ("lease_fence", true),
        // Every role: the poisoning bound.
        ("max_token_jump", false),
        ("next_fence", true),
        ("note_timeline", true),
        ("record_rejection", false),
        // Every role: which migrations are applied.
        ("schema_version", true),
        ("stop_unless", false),
        // Every role: the database's timeline (the repository's statements inline it).
        ("timeline", false),
        ("try_check", true),
        ("try_check", true),
    ]
    .iter()
    .map(|(n, d)| ((*n).to_owned(), *d))
    .collect();
    assert_eq!(functions, expected);
    let usage: bool =
        sqlx::query_scalar("SELECT has_schema_privilege($1::regrole, 'pgfence', 'USAGE')")
            .bind(app.quoted())
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(usage);
    // PUBLIC gets nothing but record_rejection, an invoker-rights wrapper of append_audit
    // (triggers fire without EXECUTE on their function).
    let public: Vec<String> = sqlx::query_scalar(
        "SELECT p.proname::text FROM pg_proc p, aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
          WHERE p.pronamespace = 'pgfence'::regnamespace AND a.grantee = 0
         UNION ALL
         SELECT c.relname::text FROM pg_class c, aclexplode(c.relacl) a
          WHERE c.relnamespace = 'pgfence'::regnamespace AND a.grantee = 0",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let mut public = public;
    public.sort();
    // record_rejection runs with the caller's rights; schema_version tells any role which
    // migrations are applied; the poisoning bound is a number any role may read; the
    // database's timeline is read by the repository's statements as whoever writes. The fence
    // layout's helpers are internal (docs/sql.md, "Functions"): nobody's.
    assert_eq!(
        public,
        [
            "max_token_jump",
            "record_rejection",
            "schema_version",
            "timeline",
        ]
        .map(str::to_owned)
    );

    // The schema's owner is refused: the revocations would strip its own privileges.
    let owner: String = sqlx::query_scalar(
        "SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'pgfence'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let err = pgfence::admin::grant(&db.pool, &Ident::new(owner).unwrap())
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Invalid(pgfence::error::InvalidInput::Identifier { .. })
        ),
        "{err:?}"
    );
    // A role that does not exist is the database's error.
    let err = pgfence::admin::grant(&db.pool, &Ident::new("pgfence no such role").unwrap())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Backend(b) if b.kind() == pgfence::error::BackendKind::Database),
        "{err:?}"
    );
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

/// Shadows of catalog functions and operators the migrations use unqualified (in CHECK
/// constraints and column defaults, which record what they resolved to in pg_depend). Each
/// gives a wrong answer, so a migration that picked one would also misbehave.
const HOSTILE: &str = r#"
CREATE SCHEMA hostile;
GRANT USAGE ON SCHEMA hostile TO PUBLIC;
CREATE FUNCTION hostile.length(text) RETURNS integer LANGUAGE sql AS 'SELECT 42';
CREATE FUNCTION hostile.now() RETURNS timestamptz LANGUAGE sql AS $$ SELECT 'epoch'::timestamptz $$;
CREATE FUNCTION hostile.clock_timestamp() RETURNS timestamptz LANGUAGE sql AS $$ SELECT 'epoch'::timestamptz $$;
CREATE FUNCTION hostile.gt_int8_int4(bigint, integer) RETURNS boolean LANGUAGE sql AS 'SELECT true';
CREATE OPERATOR hostile.> (LEFTARG = bigint, RIGHTARG = integer, FUNCTION = hostile.gt_int8_int4);
CREATE FUNCTION hostile.ge_int4(integer, integer) RETURNS boolean LANGUAGE sql AS 'SELECT true';
CREATE OPERATOR hostile.>= (LEFTARG = integer, RIGHTARG = integer, FUNCTION = hostile.ge_int4);
CREATE FUNCTION hostile.le_int4(integer, integer) RETURNS boolean LANGUAGE sql AS 'SELECT true';
CREATE OPERATOR hostile.<= (LEFTARG = integer, RIGHTARG = integer, FUNCTION = hostile.le_int4);
CREATE FUNCTION hostile.eq_text(text, text) RETURNS boolean LANGUAGE sql AS 'SELECT true';
CREATE OPERATOR hostile.= (LEFTARG = text, RIGHTARG = text, FUNCTION = hostile.eq_text);
CREATE FUNCTION hostile.lt_int8(bigint, bigint) RETURNS boolean LANGUAGE sql AS 'SELECT false';
CREATE OPERATOR hostile.< (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = hostile.lt_int8);
CREATE FUNCTION hostile.ne_text(text, text) RETURNS boolean LANGUAGE sql AS 'SELECT false';
CREATE OPERATOR hostile.<> (LEFTARG = text, RIGHTARG = text, FUNCTION = hostile.ne_text);
CREATE FUNCTION hostile.ne_oid(oid, oid) RETURNS boolean LANGUAGE sql AS 'SELECT false';
CREATE OPERATOR hostile.<> (LEFTARG = oid, RIGHTARG = oid, FUNCTION = hostile.ne_oid);
"#;

/// pg_depend rows by which an object outside `hostile` depends on something in it.
const DEPENDS_ON_HOSTILE: &str = "
WITH h AS (
    SELECT 'pg_proc'::regclass AS cls, oid FROM pg_proc WHERE pronamespace = 'hostile'::regnamespace
    UNION ALL SELECT 'pg_operator'::regclass, oid FROM pg_operator WHERE oprnamespace = 'hostile'::regnamespace
    UNION ALL SELECT 'pg_type'::regclass, oid FROM pg_type WHERE typnamespace = 'hostile'::regnamespace
    UNION ALL SELECT 'pg_namespace'::regclass, 'hostile'::regnamespace::oid
)
SELECT pg_describe_object(d.classid, d.objid, d.objsubid) || ' -> '
       || pg_describe_object(d.refclassid, d.refobjid, d.refobjsubid)
  FROM pg_depend d
 WHERE (d.refclassid, d.refobjid) IN (SELECT cls, oid FROM h)
   AND (d.classid, d.objid) NOT IN (SELECT cls, oid FROM h)
 ORDER BY 1";

/// A non-superuser migrating role whose search_path puts a schema of shadows before the
/// catalog: the migrations pin their own search_path, so no pgfence object depends on the
/// shadows, and the check still works for that role's sessions.
#[tokio::test]
async fn migrations_ignore_a_hostile_search_path() {
    let db = TestDb::empty().await;
    db.exec(HOSTILE).await;
    let owner = Role::create(&db, "pgfence_owner", "NOSUPERUSER").await;
    db.exec(&format!(
        "GRANT CREATE ON DATABASE \"{db}\" TO {r};
         ALTER ROLE {r} IN DATABASE \"{db}\" SET search_path = hostile, pg_catalog, public;",
        db = db.name,
        r = owner.quoted()
    ))
    .await;
    let pool = owner.pool(&db).await;
    // The shadows are live in the migrating role's sessions.
    let path: String = sqlx::query_scalar("SHOW search_path")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(path, "hostile, pg_catalog, public");
    let shadowed: i32 = sqlx::query_scalar("SELECT length('abc')")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(shadowed, 42, "the shadows are reachable");

    let applied = pgfence::admin::migrate(&pool).await.unwrap();
    let shipped = pgfence::admin::migration_status(&db.pool).await.unwrap();
    assert_eq!(applied.len(), shipped.len());
    let owned_by: String = sqlx::query_scalar(
        "SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'pgfence'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(owned_by, owner.quoted().trim_matches('"'));

    let deps: Vec<String> = sqlx::query_scalar(DEPENDS_ON_HOSTILE)
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        deps,
        Vec::<String>::new(),
        "pgfence objects depend on the shadows"
    );
    // (Built-in objects are pinned and get no pg_depend rows, so the check is also shown by
    // behaviour: the resource name CHECK uses the catalog's length, not the shadow's 42.)
    let state = sqlstate(
        sqlx::query("INSERT INTO pgfence.resource_fence (resource, fence) VALUES ('', 1)")
            .execute(&pool)
            .await,
    );
    assert_eq!(state, "23514");

    // The check, in the hostile sessions, as the owner and as a granted application role.
    let fence = Fence::new(pool.clone());
    let res = Resource::new("hostile:check").unwrap();
    fence.check(&pool, &res, token(3)).await.unwrap();
    let err = fence.check(&pool, &res, token(2)).await.unwrap_err();
    support::assert_stale(&err, 2, 3);
    let app = Role::create(&db, "pgfence_app", "").await;
    db.exec(&format!(
        "ALTER ROLE {r} IN DATABASE \"{db}\" SET search_path = hostile, pg_catalog, public",
        db = db.name,
        r = app.quoted()
    ))
    .await;
    pgfence::admin::grant(&pool, &app.ident()).await.unwrap();
    let app_pool = app.pool(&db).await;
    let app_fence = Fence::new(app_pool.clone());
    app_fence.check(&app_pool, &res, token(4)).await.unwrap();
    let err = app_fence
        .check(&app_pool, &res, token(3))
        .await
        .unwrap_err();
    support::assert_stale(&err, 3, 4);
    let rows: Vec<(String, i64, bool)> = sqlx::query_as(
        "SELECT operation, presented, at > now() - interval '1 hour' FROM pgfence.audit ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        rows,
        vec![("check".into(), 2, true), ("check".into(), 3, true)],
        "audit rows get the catalog's clock, not the shadow's epoch"
    );
    app_pool.close().await;
    pool.close().await;
}

/// `pgfence.try_check`: the SQL check that records its rejections instead of raising them.
#[tokio::test]
async fn try_check_records_sql_side_rejections() {
    let (db, app, pool) = with_app().await;
    let mut conn = pool.acquire().await.unwrap();
    let try_check = |token: i64, tag: i32| {
        sqlx::query_scalar::<_, bool>("SELECT pgfence.try_check('sql:job', $1, $2)")
            .bind(token)
            .bind(tag)
    };

    // Admitted: the mark is raised and the row lock held until the transaction ends.
    sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
    assert!(try_check(10, 5).fetch_one(&mut *conn).await.unwrap());
    let mut other = PgConnection::connect_with(&db.options).await.unwrap();
    let state = sqlstate(
        sqlx::raw_sql("SET lock_timeout = '100ms'; SELECT pgfence.check('sql:job', 11)")
            .execute(&mut other)
            .await,
    );
    assert_eq!(
        state, "55P03",
        "a newer check waits for the admitted transaction"
    );
    other.close().await.unwrap();
    sqlx::query("COMMIT").execute(&mut *conn).await.unwrap();
    assert!(
        try_check(10, 5).fetch_one(&mut *conn).await.unwrap(),
        "same lease again"
    );

    // Stale, in a transaction that keeps its own lock_timeout, then commits: the row stays.
    sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '7s'")
        .execute(&mut *conn)
        .await
        .unwrap();
    assert!(!try_check(9, 5).fetch_one(&mut *conn).await.unwrap());
    let lock_timeout: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(lock_timeout, "7s");
    sqlx::query("COMMIT").execute(&mut *conn).await.unwrap();

    // Duplicate token (same token, another holder's tag): false, audited with current = presented.
    assert!(!try_check(10, 6).fetch_one(&mut *conn).await.unwrap());
    // A rejection rolled back with its transaction takes its audit row with it (documented).
    sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
    assert!(!try_check(8, 5).fetch_one(&mut *conn).await.unwrap());
    sqlx::query("ROLLBACK").execute(&mut *conn).await.unwrap();
    // Invalid arguments still raise.
    let state = sqlstate(try_check(0, 5).fetch_one(&mut *conn).await);
    assert_eq!(state, "22023");

    let who = Some(app.name.clone());
    assert_eq!(
        audit_rows(&db).await,
        vec![
            ("check".into(), 9, Some(10), who.clone(), who.clone()),
            ("check".into(), 10, Some(10), who.clone(), who.clone()),
        ]
    );
    let resources: Vec<(Option<String>, Option<String>, Option<String>)> =
        sqlx::query_as("SELECT resource, table_name, row_key FROM pgfence.audit")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert!(
        resources
            .iter()
            .all(|r| *r == (Some("sql:job".into()), None, None))
    );
    // The mark is the admitted lease's.
    assert_eq!(
        pgfence::admin::high_water(&db.pool, &Resource::new("sql:job").unwrap())
            .await
            .unwrap(),
        10
    );
    drop(conn);
    pool.close().await;
}

/// Poisoning: a check with the highest token (or a raw fence of i64::MAX) locks a resource
/// (a row) against every future token. The owner recovers a resource with
/// `pgfence.unpoison_resource` (audited) and a row by updating it with the guard disabled.
#[tokio::test]
async fn the_owner_can_unpoison_a_resource_and_a_row() {
    let (db, _app, pool) = with_app().await;
    let fence = Fence::new(pool.clone());
    let res = Resource::new("poison:me").unwrap();
    fence.check(&pool, &res, token(10)).await.unwrap();
    // The app role cannot poison the mark with the highest valid token: too far above the
    // mark (the poisoning bound), refused and audited.
    let audited = support::audit_count(&db.pool).await;
    let err = fence
        .check(&pool, &res, token(pgfence::token::MAX_TOKEN))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::TokenJump {
                current: 10,
                max_jump: 68_719_476_736,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(support::audit_count(&db.pool).await, audited + 1);
    fence.check(&pool, &res, token(11)).await.unwrap();
    // A mark poisoned anyway (by hand, as the owner; or before 0.3) still locks leases out
    // until the owner unpoisons it.
    db.exec(&format!(
        "UPDATE pgfence.resource_fence SET fence = pgfence.lease_fence({}, 0) WHERE resource = 'poison:me'",
        pgfence::token::MAX_TOKEN
    ))
    .await;
    let err = fence.check(&pool, &res, token(12)).await.unwrap_err();
    assert!(err.is_stale(), "{err:?}");
    // Beyond the highest token, the check refuses the token itself.
    let state = sqlstate(
        sqlx::query("SELECT pgfence.check('poison:me', 549755813888)")
            .execute(&pool)
            .await,
    );
    assert_eq!(state, "22023");

    // Only the owner may unpoison.
    let state = sqlstate(
        sqlx::query("SELECT pgfence.unpoison_resource('poison:me', 10)")
            .execute(&pool)
            .await,
    );
    assert_eq!(state, "42501");
    // It lowers, never raises.
    let state = sqlstate(
        sqlx::raw_sql(
            "SELECT pgfence.unpoison_resource('poison:none', 1);
             SELECT pgfence.check('poison:none', 5);
             SELECT pgfence.unpoison_resource('poison:none', 6)",
        )
        .execute(&db.pool)
        .await,
    );
    assert_eq!(state, "22023");
    let was: Option<i64> = sqlx::query_scalar("SELECT pgfence.unpoison_resource('poison:me', 10)")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(was, Some(pgfence::token::MAX_TOKEN));
    assert_eq!(fence.high_water(&res).await.unwrap(), 10);
    // Token 10 itself stays refused, whatever its tag; 11 is admitted.
    let err = fence.check(&pool, &res, token(10)).await.unwrap_err();
    assert!(
        matches!(err, Error::StaleToken { .. } | Error::DuplicateToken { .. }),
        "{err:?}"
    );
    fence.check(&pool, &res, token(11)).await.unwrap();
    // Unpoisoning to 0 removes the mark.
    let was: Option<i64> = sqlx::query_scalar("SELECT pgfence.unpoison_resource('poison:me', 0)")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(was, Some(11));
    assert_eq!(fence.high_water(&res).await.unwrap(), 0);
    let unpoisoned: Vec<UnpoisonRow> = sqlx::query_as(
        "SELECT resource, presented, current, holder FROM pgfence.audit
          WHERE operation = 'unpoison' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let owner: String = sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        unpoisoned,
        vec![
            (
                Some("poison:me".into()),
                10,
                Some(pgfence::token::MAX_TOKEN),
                Some(owner.clone())
            ),
            (Some("poison:me".into()), 0, Some(11), Some(owner)),
        ]
    );

    // A row: the app role's raw SQL cannot store a fence absurdly far above the row's (the
    // poisoning bound) nor one no lease writes; the owner, with the guard off, can.
    let repo = Repository::<Acct>::new(pool.clone()).unwrap();
    repo.update(&pool, token(3), &acct(1, 103)).await.unwrap();
    let state =
        sqlx::query("UPDATE acct SET fence = pgfence.lease_fence(549755813887, 0) WHERE id = 1")
            .execute(&pool)
            .await;
    assert_eq!(sqlstate(state), "PF008");
    let state = sqlx::query("UPDATE acct SET fence = fence + 1 WHERE id = 1")
        .execute(&pool)
        .await;
    assert_eq!(sqlstate(state), "PF007");
    db.exec(
        "ALTER TABLE acct DISABLE TRIGGER pgfence_guard;
         UPDATE acct SET fence = 9223372036854775807 WHERE id = 1;
         ALTER TABLE acct ENABLE TRIGGER pgfence_guard;",
    )
    .await;
    let err = repo
        .update(&pool, token(20), &acct(1, 120))
        .await
        .unwrap_err();
    assert!(err.is_stale(), "{err:?}");
    // The app role cannot lower it; the table's owner can, with the guard off for one
    // transaction (documented recovery), to the token the issuer really reached.
    let state = sqlx::query("UPDATE acct SET fence = 19::bigint << 24 WHERE id = 1")
        .execute(&pool)
        .await;
    assert_eq!(sqlstate(state), "PF001");
    db.exec(
        "BEGIN;
         ALTER TABLE acct DISABLE TRIGGER pgfence_guard;
         UPDATE acct SET fence = (19::bigint << 24) | 16777215 WHERE id = 1;
         ALTER TABLE acct ENABLE TRIGGER pgfence_guard;
         COMMIT;",
    )
    .await;
    // Token 19 stays refused; 20 and later write again.
    let err = repo
        .update(&pool, token(19), &acct(1, 119))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::StaleToken { .. } | Error::DuplicateToken { .. }),
        "{err:?}"
    );
    repo.update(&pool, token(20), &acct(1, 120)).await.unwrap();
    repo.update(&pool, token(20), &acct(1, 121)).await.unwrap();
    // The guard is back on.
    let enabled: String = sqlx::query_scalar(
        "SELECT tgenabled::text FROM pg_trigger WHERE tgname = 'pgfence_guard' AND tgrelid = 'acct'::regclass",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(enabled, "O");
    pool.close().await;
}
