//! The 0.3 migration is the unreleased chain it replaced: `migrations/V7__pgfence_0_3.sql`
//! leaves exactly what main's V7..V13 (kept verbatim in `tests/fixtures/pre_squash`) left, on
//! an empty database and on a populated 0.2.0 one, compared with `pg_dump` (every function's
//! definition and body, every table, index, constraint, trigger with its WHEN clause, and every
//! grant); and a database that ran the unreleased chain is refused with what to do, and repaired
//! by doing it.

use std::path::{Path, PathBuf};
use std::process::Command;

use pgfence::admin::{DoctorOptions, FindingKind};
use sqlx::{AssertSqlSafe, Connection, PgConnection};

use crate::support::{Role, TestDb};

/// refinery's history table, as refinery-core 0.10 creates it.
const HISTORY_DDL: &str = "CREATE TABLE IF NOT EXISTS pgfence.refinery_schema_history(
             version int4 PRIMARY KEY,
             name VARCHAR(255),
             applied_on VARCHAR(255),
             checksum VARCHAR(255));";

/// The `.sql` files of `dir` as `(stem, SQL)`, by version.
fn sql_files(dir: &Path) -> Vec<(String, String)> {
    let mut files: Vec<(u32, String, String)> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "sql"))
        .map(|p| {
            let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
            let version = stem[1..].split("__").next().unwrap().parse().unwrap();
            (version, stem, std::fs::read_to_string(&p).unwrap())
        })
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|(_, stem, sql)| (stem, sql))
        .collect()
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The migrations this version ships (`migrations/`).
fn shipped() -> Vec<(String, String)> {
    sql_files(&root().join("migrations"))
}

/// main's unreleased V7..V13, as they were before the squash.
fn pre_squash() -> Vec<(String, String)> {
    let files = sql_files(&root().join("tests/fixtures/pre_squash"));
    assert_eq!(
        files.iter().map(|(s, _)| s.as_str()).collect::<Vec<_>>(),
        [
            "V7__pg_issuer",
            "V8__effects",
            "V9__schema_version",
            "V10__fences_people_cannot_break",
            "V11__failover_fencing",
            "V12__fence_layout",
            "V13__issuer_token_limit"
        ]
    );
    files
}

/// Applies one migration the way `pgfence::admin::migrate` has refinery apply it: in its own
/// transaction, with the search path migrate pins, and its history row (refinery's name and
/// checksum) recorded in the same transaction.
async fn apply(conn: &mut PgConnection, stem: &str, sql: &str) {
    let migration = refinery_core::Migration::unapplied(stem, sql).unwrap();
    let mut tx = conn.begin().await.unwrap();
    sqlx::raw_sql("SET LOCAL search_path = pg_catalog, pg_temp")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
        .execute(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("{stem}: {e}"));
    sqlx::query("INSERT INTO pgfence.refinery_schema_history VALUES ($1, $2, $3, $4)")
        .bind(migration.version())
        .bind(migration.name())
        .bind("2026-11-01T00:00:00Z")
        .bind(migration.checksum().to_string())
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

/// pgfence 0.2.0's schema (V1..V6), recorded as refinery records it: `pgfence::admin::migrate`
/// applies only what 0.3 adds.
pub(crate) async fn apply_0_2_0(conn: &mut PgConnection) {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE SCHEMA pgfence; {HISTORY_DDL}"
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
    let released: Vec<_> = shipped().into_iter().take(6).collect();
    assert_eq!(released.last().unwrap().0, "V6__observe_mode");
    for (stem, sql) in released {
        apply(conn, &stem, &sql).await;
    }
}

/// What changed in the 0.3 migration since the squash, as deltas over the chain
/// (`tests/fixtures/since_squash`): unreleased migrations are edited, and each edit is kept
/// here too, so the chain plus these is still what the 0.3 migration must leave.
fn since_squash() -> Vec<(String, String)> {
    sql_files(&root().join("tests/fixtures/since_squash"))
}

/// Upgrades a 0.2.0 database (or an empty one with V1..V6) with the unreleased chain.
async fn apply_pre_squash(db: &TestDb) {
    let mut conn = PgConnection::connect_with(&db.options).await.unwrap();
    for (stem, sql) in pre_squash() {
        apply(&mut conn, &stem, &sql).await;
    }
    conn.close().await.unwrap();
}

/// The chain and every edit since the squash: what the 0.3 migration must leave.
async fn apply_chain_and_edits(db: &TestDb) {
    apply_pre_squash(db).await;
    let mut conn = PgConnection::connect_with(&db.options).await.unwrap();
    for (stem, sql) in since_squash() {
        apply(&mut conn, &stem, &sql).await;
    }
    conn.close().await.unwrap();
}

/// `pg_dump`: `PGFENCE_PG_BINDIR`, the newest `/usr/lib/postgresql/*/bin` (it must not be
/// older than the server), else `PATH`.
fn pg_dump() -> Option<PathBuf> {
    let env = std::env::var_os("PGFENCE_PG_BINDIR").map(|d| PathBuf::from(d).join("pg_dump"));
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            Some((v, e.path().join("bin/pg_dump")))
        })
        .collect();
    versions.sort();
    let path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    env.into_iter()
        .chain(versions.into_iter().rev().map(|(_, p)| p))
        .chain(path.into_iter().map(|d| d.join("pg_dump")))
        .chain([PathBuf::from("/usr/local/bin/pg_dump")])
        .find(|p| p.is_file())
}

/// `pg_dump` of `db` with `args`, without the `\restrict` key newer pg_dumps draw at random.
fn dump(pg_dump: &Path, db: &TestDb, args: &[&str]) -> String {
    let out = Command::new(pg_dump)
        .arg(format!("--dbname={}", db.url()))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", pg_dump.display()));
    assert!(
        out.status.success(),
        "{} {args:?}: {}",
        pg_dump.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with("\\restrict") && !l.starts_with("\\unrestrict"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The whole schema: pgfence's (functions with their bodies, tables, indexes, constraints,
/// ownership and grants), the user's tables and their guard triggers with the WHEN clause.
fn schema(pg_dump: &Path, db: &TestDb) -> String {
    dump(pg_dump, db, &["--schema-only"])
}

/// Every row, but the two tables that record when a migration ran (refinery's history, the
/// timeline pgfence was installed on: compared by [`installed_timelines`]).
fn data(pg_dump: &Path, db: &TestDb) -> String {
    dump(
        pg_dump,
        db,
        &[
            "--data-only",
            "--exclude-table-data=pgfence.refinery_schema_history",
            "--exclude-table-data=pgfence.timeline_history",
        ],
    )
}

/// The timeline history without its timestamps.
async fn installed_timelines(db: &TestDb) -> Vec<(i64, bool, Option<String>)> {
    sqlx::query_as(
        "SELECT timeline, acknowledged_at IS NOT NULL, acknowledged_by
           FROM pgfence.timeline_history ORDER BY timeline",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// Every guard trigger: table, enabled state and definition (its WHEN clause and mode).
async fn guard_triggers(db: &TestDb) -> Vec<(String, String, String)> {
    sqlx::query_as(
        "SELECT t.tgrelid::regclass::text, t.tgenabled::text, pg_get_triggerdef(t.oid)
           FROM pg_trigger t WHERE t.tgname = 'pgfence_guard' ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// Every function of schema pgfence with its privileges, from the catalog.
async fn function_acls(db: &TestDb) -> Vec<(String, Option<String>)> {
    sqlx::query_as(
        "SELECT p.oid::regprocedure::text, p.proacl::text FROM pg_proc p
          WHERE p.pronamespace = 'pgfence'::regnamespace ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// Panics with the lines that differ when `chain` and `squash` are not the same text.
#[track_caller]
fn assert_same(what: &str, chain: &str, squash: &str) {
    if chain == squash {
        return;
    }
    let a: Vec<&str> = chain.lines().collect();
    let b: Vec<&str> = squash.lines().collect();
    let first = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let from = first.saturating_sub(5);
    panic!(
        "{what} differs from line {}:\n--- chain (V7..V13)\n{}\n+++ squash (V7__pgfence_0_3)\n{}",
        first + 1,
        a[from..a.len().min(first + 20)].join("\n"),
        b[from..b.len().min(first + 20)].join("\n"),
    );
}

/// The schema, data, guard triggers and function privileges of both databases are the same.
async fn assert_same_database(pg_dump: &Path, chain: &TestDb, squash: &TestDb) {
    let (chain_schema, squash_schema) = (schema(pg_dump, chain), schema(pg_dump, squash));
    assert!(
        chain_schema.contains("CREATE FUNCTION pgfence.issuer_acquire("),
        "the dump holds pgfence's functions"
    );
    assert_same("pg_dump --schema-only", &chain_schema, &squash_schema);
    assert_same(
        "pg_dump --data-only",
        &data(pg_dump, chain),
        &data(pg_dump, squash),
    );
    assert_eq!(guard_triggers(chain).await, guard_triggers(squash).await);
    assert_eq!(function_acls(chain).await, function_acls(squash).await);
    assert_eq!(
        installed_timelines(chain).await,
        installed_timelines(squash).await
    );
}

/// The functions `sql` (re)defines, one entry per definition: name and parameters as written
/// (whitespace collapsed), e.g. `pgfence.check(p_resource text, p_token bigint, p_tag integer
/// DEFAULT 0)`.
fn definitions(sql: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = sql;
    while let Some(at) = rest.find("FUNCTION pgfence.") {
        let line_start = rest[..at].rfind('\n').map_or(0, |i| i + 1);
        // Top-level statements only (a function that defines another, like
        // configure_timeline, indents it).
        let head = rest[line_start..at].trim_end();
        let from = at + "FUNCTION ".len();
        let to = from + rest[from..].find(')').unwrap() + 1;
        if head == "CREATE" || head == "CREATE OR REPLACE" {
            found.push(
                rest[from..to]
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" "),
            );
        }
        rest = &rest[to..];
    }
    found
}

macro_rules! pg_dump_or_skip {
    () => {
        match pg_dump() {
            Some(p) => p,
            None => {
                eprintln!(
                    "SKIPPED: pg_dump not found (PGFENCE_PG_BINDIR, /usr/lib/postgresql/*/bin, PATH): the squash is not compared"
                );
                return;
            }
        }
    };
}

/// An empty database: V1..V6 and the unreleased V7..V13, applied as refinery would, leave what
/// `pgfence::admin::migrate` (V1..V6 and V7__pgfence_0_3) leaves.
#[tokio::test]
async fn an_empty_database_gets_from_the_squash_what_the_chain_gave() {
    let pg_dump = pg_dump_or_skip!();
    let squash_sql = &shipped()[6].1;
    assert_eq!(shipped().len(), 7, "0.3 ships V1..V6 and one migration");
    // Each function once, in its final form: the squash defines every function the chain
    // defined (70 definitions of 59 functions), one time each.
    let mut chain_defs: Vec<String> = pre_squash()
        .iter()
        .chain(&since_squash())
        .flat_map(|(_, sql)| definitions(sql))
        .collect();
    let edits = since_squash()
        .iter()
        .map(|(_, sql)| definitions(sql).len())
        .sum::<usize>();
    // (70 definitions in the chain; V10 creates max_token_jump() inside a DO block, which
    // counts as nested here.)
    assert_eq!(chain_defs.len(), 69 + edits);
    let name = |d: &String| d[..d.find('(').unwrap()].to_owned();
    let arity = |d: &String| d.matches(',').count();
    chain_defs.sort_by_key(|d| (name(d), arity(d)));
    chain_defs.dedup_by_key(|d| (name(d), arity(d)));
    let mut squash_defs = definitions(squash_sql);
    squash_defs.sort_by_key(|d| (name(d), arity(d)));
    assert_eq!(
        squash_defs
            .iter()
            .map(|d| (name(d), arity(d)))
            .collect::<Vec<_>>(),
        chain_defs
            .iter()
            .map(|d| (name(d), arity(d)))
            .collect::<Vec<_>>()
    );
    // 59 at the squash; since: fence_tag and record_rejection with a reason (issue 30),
    // configure_timeline (issue 33); issuer_floor_bucket, issuer_expire_idle, issuer_state
    // (issue 45); max_token_jump() is created inside a DO block (nested).
    assert_eq!(squash_defs.len(), 64);

    let chain = TestDb::empty().await;
    let mut conn = PgConnection::connect_with(&chain.options).await.unwrap();
    apply_0_2_0(&mut conn).await;
    conn.close().await.unwrap();
    apply_chain_and_edits(&chain).await;

    let squash = TestDb::empty().await;
    let applied = pgfence::admin::migrate(&squash.pool).await.unwrap();
    assert_eq!(
        applied.iter().map(|m| m.version).collect::<Vec<_>>(),
        (1..=7).collect::<Vec<_>>()
    );
    assert_same_database(&pg_dump, &chain, &squash).await;
}

/// A 0.2.0 database with guarded tables (enforcing, observing, disabled; fences of leases,
/// a 0.2 seal, audited bypass and observe rows), resource marks, an application role and a
/// bypass role, and its copies.
struct Populated {
    copies: Vec<TestDb>,
    // Dropped after the copies (a role with privileges in a database cannot be dropped) and
    // before the database they were created in.
    _roles: [Role; 2],
    _base: TestDb,
}

async fn populated_0_2_0(copies: usize) -> Populated {
    let base = TestDb::empty().await;
    let mut conn = PgConnection::connect_with(&base.options).await.unwrap();
    apply_0_2_0(&mut conn).await;
    conn.close().await.unwrap();
    let app = Role::create(&base, "squash_app", "").await;
    let admin = Role::create(&base, "squash_admin", "").await;
    let (app_q, admin_q) = (app.quoted(), admin.quoted());
    base.exec(&format!(
        "CREATE TABLE accounts (id bigint PRIMARY KEY, balance bigint NOT NULL);
         INSERT INTO accounts SELECT g, 0 FROM generate_series(1, 20) g;
         SELECT pgfence.guard('public', 'accounts');
         CREATE TABLE ledger (id text PRIMARY KEY, note text);
         INSERT INTO ledger VALUES ('a', NULL), ('b', NULL);
         SELECT pgfence.guard('public', 'ledger', 'observe');
         CREATE SCHEMA billing;
         CREATE TABLE billing.\"Invoice \"\"Lines\"\"\" (id int PRIMARY KEY, total bigint);
         INSERT INTO billing.\"Invoice \"\"Lines\"\"\" VALUES (1, 10);
         SELECT pgfence.guard('billing', 'Invoice \"Lines\"');
         ALTER TABLE billing.\"Invoice \"\"Lines\"\"\" DISABLE TRIGGER pgfence_guard;
         -- What 0.2.0's `pgfence grant` gave the application role (a part of it).
         GRANT USAGE ON SCHEMA pgfence TO {app_q};
         GRANT EXECUTE ON FUNCTION pgfence.check(text, bigint, integer),
             pgfence.try_check(text, bigint, integer), pgfence.high_water(text),
             pgfence.next_fence(bigint, bigint, integer, text),
             pgfence.lease_fence(bigint, integer) TO {app_q};
         GRANT SELECT, UPDATE ON accounts, ledger TO {app_q}, {admin_q};
         SELECT pgfence.allow_bypass('{}');",
        admin.name
    ))
    .await;
    // 0.2's writes: lease 5 wrote row 1 four times, lease 7 (tag 3) row 2, lease 5 row 3
    // 4,096 times (the 0.2 cap, sequence 4095); an audited bypass of row 4 and an observed
    // write (audit table names in 0.2's spelling); resource marks and a stale check.
    base.exec(&format!(
        "UPDATE accounts SET fence = pgfence.next_fence(fence, 5, 0) WHERE id = 1;
         UPDATE accounts SET fence = pgfence.next_fence(fence, 5, 0) WHERE id = 1;
         UPDATE accounts SET fence = pgfence.next_fence(fence, 5, 0) WHERE id = 1;
         UPDATE accounts SET fence = pgfence.next_fence(fence, 5, 0) WHERE id = 1;
         UPDATE accounts SET fence = pgfence.next_fence(fence, 7, 3) WHERE id = 2;
         UPDATE accounts SET fence = pgfence.lease_fence(5, 0) + 4095 WHERE id = 3;
         BEGIN;
         SET LOCAL ROLE {admin_q};
         SET LOCAL pgfence.bypass = 'refund #123';
         UPDATE accounts SET balance = 9 WHERE id = 4;
         COMMIT;
         UPDATE ledger SET note = 'by hand' WHERE id = 'a';
         SELECT pgfence.check('billing:run', 3, 0);
         SELECT pgfence.check('{{billing}}acct:1', 4, 0);
         SELECT pgfence.try_check('billing:run', 2, 0);"
    ))
    .await;
    let audited: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT table_name FROM pgfence.audit WHERE table_name IS NOT NULL ORDER BY 1",
    )
    .fetch_all(&base.pool)
    .await
    .unwrap();
    assert_eq!(
        audited,
        ["public.accounts", "public.ledger"],
        "0.2's spelling"
    );
    let copies = base.copies(copies).await;
    Populated {
        copies,
        _roles: [app, admin],
        _base: base,
    }
}

/// A populated 0.2.0 database upgraded by the unreleased chain and by the squash: the same
/// schema (guard triggers re-installed in their modes, a disabled one still disabled, grants to
/// the roles 0.2.0 had), the same data (fences as they were, audit table names converted).
#[tokio::test]
async fn a_0_2_0_database_upgrades_by_the_squash_to_what_the_chain_gave() {
    let pg_dump = pg_dump_or_skip!();
    let populated = populated_0_2_0(2).await;
    let [chain, squash] = &populated.copies[..] else {
        unreachable!()
    };
    apply_chain_and_edits(chain).await;
    let applied = pgfence::admin::migrate(&squash.pool).await.unwrap();
    assert_eq!(
        applied
            .iter()
            .map(|m| (m.version, m.name.as_str()))
            .collect::<Vec<_>>(),
        [(7, "pgfence_0_3")],
        "a 0.2.0 database runs only the 0.3 migration"
    );
    assert_same_database(&pg_dump, chain, squash).await;
    let audited: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT table_name FROM pgfence.audit WHERE table_name IS NOT NULL ORDER BY 1",
    )
    .fetch_all(&squash.pool)
    .await
    .unwrap();
    assert_eq!(
        audited,
        ["\"public\".\"accounts\"", "\"public\".\"ledger\""]
    );
    let triggers = guard_triggers(squash).await;
    assert_eq!(
        triggers
            .iter()
            .map(|(t, enabled, _)| (t.as_str(), enabled.as_str()))
            .collect::<Vec<_>>(),
        [
            ("accounts", "O"),
            ("billing.\"Invoice \"\"Lines\"\"\"", "D"),
            ("ledger", "O")
        ]
    );
    assert!(triggers[2].2.contains("reject_stale_update('observe')"));

    // Applied again over itself (a repaired history row), the squash changes nothing.
    squash
        .exec("DELETE FROM pgfence.refinery_schema_history WHERE version = 7")
        .await;
    assert_eq!(
        pgfence::admin::migrate(&squash.pool).await.unwrap().len(),
        1
    );
    assert_same_database(&pg_dump, chain, squash).await;
}

/// A database that ran the unreleased build's V7..V13 is refused with what to do (nothing is
/// changed); done, the squash applies over the chain's objects and leaves what it leaves on a
/// 0.2.0 database.
#[tokio::test]
async fn the_unreleased_history_is_refused_then_repaired_as_the_error_says() {
    let pg_dump = pg_dump_or_skip!();
    let populated = populated_0_2_0(2).await;
    let [chain, squash] = &populated.copies[..] else {
        unreachable!()
    };
    apply_pre_squash(chain).await;
    pgfence::admin::migrate(&squash.pool).await.unwrap();
    let before = schema(&pg_dump, chain);

    let err = pgfence::admin::migrate(&chain.pool).await.unwrap_err();
    match &err {
        pgfence::Error::UnreleasedMigrations { versions } => {
            assert_eq!(versions, &(7..=13).collect::<Vec<_>>());
        }
        e => panic!("{e:?}"),
    }
    assert_eq!(err.kind(), pgfence::error::ErrorKind::Setup);
    let text = err.to_string();
    assert!(
        text.contains("V7, V8, V9, V10, V11, V12, V13")
            && text.contains(
                "DELETE FROM pgfence.refinery_schema_history WHERE version BETWEEN 7 AND 13"
            ),
        "{text}"
    );
    let err = pgfence::admin::migration_status(&chain.pool)
        .await
        .unwrap_err();
    assert!(
        matches!(err, pgfence::Error::UnreleasedMigrations { .. }),
        "{err:?}"
    );
    let findings = pgfence::admin::doctor(&chain.pool, None, &DoctorOptions::default())
        .await
        .unwrap();
    assert!(
        findings
            .iter()
            .any(|f| f.kind == FindingKind::SchemaBehind && f.message.contains("unreleased")),
        "{findings:#?}"
    );
    assert_same("nothing changed", &before, &schema(&pg_dump, chain));

    chain
        .exec("DELETE FROM pgfence.refinery_schema_history WHERE version BETWEEN 7 AND 13")
        .await;
    let applied = pgfence::admin::migrate(&chain.pool).await.unwrap();
    assert_eq!(applied.iter().map(|m| m.version).collect::<Vec<_>>(), [7]);
    assert_same_database(&pg_dump, chain, squash).await;
    assert!(
        pgfence::admin::migrate(&chain.pool)
            .await
            .unwrap()
            .is_empty()
    );
}
