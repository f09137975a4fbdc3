//! `guard --emit-migration DIR`: the file is the folder's tool's (sqlx-cli simple or
//! reversible, refinery), and each tool applies it: sqlx's own `Migrator` over the folder,
//! refinery's runner over the files it loads. In a fresh environment `pgfence migrate` comes
//! first; a guard migration run before it stops with that advice and applies nothing. Bad
//! folders and table lists change nothing.

use crate::common::test_db::stdout;
use crate::common::urls::pgfence;
use crate::common::{snapshot, text};
use crate::support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Output;

use refinery_core::traits::r#async::{AsyncQuery, AsyncTransaction};
use refinery_core::{AsyncMigrate, Migration, Runner};
use sqlx::migrate::Migrator;
use sqlx::{AssertSqlSafe, Connection, PgConnection, Row};
use support::{TestDb, redis_url};

/// A fresh folder under the temporary directory, removed when dropped.
struct Folder(PathBuf);

impl Folder {
    fn new(files: &[(&str, &str)]) -> Self {
        let dir = std::env::temp_dir().join(format!("pgfence-emit-{}", rand::random::<u64>()));
        std::fs::create_dir(&dir).unwrap();
        for (name, sql) in files {
            let path = dir.join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, sql).unwrap();
        }
        Self(dir)
    }

    fn arg(&self) -> &str {
        self.0.to_str().unwrap()
    }

    /// The files in the folder (and its subfolders), relative to it.
    fn files(&self) -> BTreeSet<String> {
        fn walk(dir: &Path, under: &str, out: &mut BTreeSet<String>) {
            for e in std::fs::read_dir(dir).unwrap() {
                let e = e.unwrap();
                let name = format!("{under}{}", e.file_name().to_string_lossy());
                if e.file_type().unwrap().is_dir() {
                    walk(&e.path(), &format!("{name}/"), out);
                } else {
                    out.insert(name);
                }
            }
        }
        let mut out = BTreeSet::new();
        walk(&self.0, "", &mut out);
        out
    }

    /// The files added since `before`.
    fn added(&self, before: &BTreeSet<String>) -> Vec<String> {
        self.files().difference(before).cloned().collect()
    }
}

impl Drop for Folder {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn run(db: &TestDb, args: &[&str]) -> Output {
    pgfence(&db.url(), &redis_url().await, args)
}

async fn emit(db: &TestDb, folder: &Folder, args: &[&str]) -> Vec<String> {
    let before = folder.files();
    let mut all = vec!["guard"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--emit-migration", folder.arg()]);
    let out = run(db, &all).await;
    assert!(out.status.success(), "{all:?}: {}", text(&out.stderr));
    let added = folder.added(&before);
    for file in &added {
        assert!(
            stdout(&out).contains(&format!("wrote {}", folder.0.join(file).display())),
            "{file} reported: {}",
            stdout(&out)
        );
    }
    added
}

async fn guarded(db: &TestDb) -> Vec<String> {
    pgfence::guard::guarded_tables(&db.pool)
        .await
        .unwrap()
        .iter()
        .map(|t| t.quoted())
        .collect()
}

/// sqlx-cli's sequential simple folder, its timestamped reversible folder and an empty
/// folder: the emitted files are named as sqlx-cli names them, and `sqlx::migrate::Migrator`
/// over the folder applies them (and reverts the reversible one).
#[tokio::test]
async fn sqlx_folders_get_files_sqlx_applies() {
    // Sequential, simple: the next number, as many digits.
    let db = TestDb::new().await;
    let folder = Folder::new(&[
        (
            "0001_orders.sql",
            "CREATE TABLE orders (id int PRIMARY KEY);",
        ),
        (
            "0002_lines.sql",
            "CREATE TABLE lines (id int PRIMARY KEY); CREATE SCHEMA billing; CREATE TABLE billing.\"Invoices\" (id int);",
        ),
        ("README.md", "not a migration"),
    ]);
    let added = emit(&db, &folder, &["orders", "lines", "billing.\"Invoices\""]).await;
    assert_eq!(added, ["0003_guard_orders_lines_billing_invoices.sql"]);
    Migrator::new(folder.0.as_path())
        .await
        .unwrap()
        .run(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        guarded(&db).await,
        [
            r#""billing"."Invoices""#,
            r#""public"."lines""#,
            r#""public"."orders""#
        ]
    );
    let recorded: Vec<(i64, String)> =
        sqlx::query_as("SELECT version, description FROM _sqlx_migrations ORDER BY version")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        recorded.last().unwrap(),
        &(3, "guard orders lines billing invoices".to_owned())
    );

    // Timestamped and reversible (the latest migration is): a pair, with a timestamp above
    // the folder's versions; sqlx applies the up file and its undo runs the down file.
    let db = TestDb::new().await;
    let folder = Folder::new(&[
        (
            "20240101000000_orders.up.sql",
            "CREATE TABLE orders (id int PRIMARY KEY);",
        ),
        ("20240101000000_orders.down.sql", "DROP TABLE orders;"),
    ]);
    let added = emit(&db, &folder, &["orders"]).await;
    assert_eq!(added.len(), 2, "{added:?}");
    let version = added[0].split('_').next().unwrap().to_owned();
    assert_eq!(version.len(), 14, "a timestamp: {added:?}");
    assert!(version.as_str() > "20240101000000", "{added:?}");
    assert_eq!(
        added,
        [
            format!("{version}_guard_orders.down.sql"),
            format!("{version}_guard_orders.up.sql")
        ]
    );
    let migrator = Migrator::new(folder.0.as_path()).await.unwrap();
    migrator.run(&db.pool).await.unwrap();
    assert_eq!(guarded(&db).await, [r#""public"."orders""#]);
    migrator.undo(&db.pool, 20_240_101_000_000).await.unwrap();
    assert!(guarded(&db).await.is_empty(), "the down migration unguards");
    let fence: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT FROM information_schema.columns WHERE table_name = 'orders' AND column_name = 'fence')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(fence, "the down migration keeps the fence column");

    // An empty folder: sqlx-cli's default, a simple migration with a timestamp.
    let db = TestDb::new().await;
    db.exec("CREATE TABLE orders (id int PRIMARY KEY)").await;
    let folder = Folder::new(&[]);
    let added = emit(&db, &folder, &["orders"]).await;
    assert_eq!(added.len(), 1);
    let (version, name) = added[0].split_once('_').unwrap();
    assert_eq!((version.len(), name), (14, "guard_orders.sql"), "{added:?}");
    Migrator::new(folder.0.as_path())
        .await
        .unwrap()
        .run(&db.pool)
        .await
        .unwrap();
    assert_eq!(guarded(&db).await, [r#""public"."orders""#]);

    // The flag picks reversible in an empty folder.
    let folder = Folder::new(&[]);
    let added = emit(
        &db,
        &folder,
        &["orders", "--migration-format", "sqlx-reversible"],
    )
    .await;
    assert!(
        added[0].ends_with("_guard_orders.down.sql") && added[1].ends_with("_guard_orders.up.sql"),
        "{added:?}"
    );
}

/// In a fresh environment the service's migrations may run before `pgfence migrate`: the
/// guard migration then stops with the advice and changes nothing, and runs once pgfence's
/// schema is there (docs/operations.md, "Guard migrations in a fresh environment").
#[tokio::test]
async fn a_guard_migration_before_pgfence_migrate_says_so_and_applies_nothing() {
    let db = TestDb::empty().await;
    let folder = Folder::new(&[(
        "0001_orders.sql",
        "CREATE TABLE orders (id int PRIMARY KEY);",
    )]);
    let added = emit(&db, &folder, &["orders"]).await;
    assert_eq!(added, ["0002_guard_orders.sql"]);
    let migrator = Migrator::new(folder.0.as_path()).await.unwrap();
    let err = migrator.run(&db.pool).await.unwrap_err().to_string();
    assert!(
        err.contains("pgfence is not installed in this database: run `pgfence migrate`"),
        "{err}"
    );
    let fence: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT FROM information_schema.columns WHERE table_name = 'orders' AND column_name = 'fence')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(!fence, "nothing of the guard migration applied");
    let out = run(&db, &["migrate"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    migrator.run(&db.pool).await.unwrap();
    assert_eq!(guarded(&db).await, [r#""public"."orders""#]);
}

/// refinery's runner over an sqlx connection (as `src/admin/migrate.rs` runs pgfence's own),
/// with refinery's default history table.
struct Refinery<'c>(&'c mut PgConnection);

impl AsyncTransaction for Refinery<'_> {
    type Error = sqlx::Error;

    async fn execute<'a, T: Iterator<Item = &'a str> + Send + 'a>(
        &'a mut self,
        queries: T,
    ) -> Result<usize, Self::Error> {
        let mut tx = Connection::begin(&mut *self.0).await?;
        let mut count = 0;
        for query in queries {
            sqlx::raw_sql(AssertSqlSafe(query))
                .execute(&mut *tx)
                .await?;
            count += 1;
        }
        tx.commit().await?;
        Ok(count)
    }
}

impl AsyncQuery<Vec<Migration>> for Refinery<'_> {
    async fn query<'a>(&'a mut self, query: &'a str) -> Result<Vec<Migration>, Self::Error> {
        let rows = sqlx::query(AssertSqlSafe(query))
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

impl AsyncMigrate for Refinery<'_> {}

async fn refinery_run(db: &TestDb, dir: &Path) -> Result<(), refinery_core::Error> {
    let migrations = refinery_core::load_sql_migrations(dir)?;
    let mut conn = PgConnection::connect_with(&db.options).await.unwrap();
    let outcome = Runner::new(&migrations)
        .set_abort_divergent(true)
        .set_abort_missing(true)
        .run_async(&mut Refinery(&mut conn))
        .await
        .map(|_| ());
    conn.close().await.unwrap();
    outcome
}

/// A refinery folder (versions in a subfolder too, and a Rust migration): `V<n>__...` one
/// above them all, and refinery's runner applies it.
#[tokio::test]
async fn refinery_folders_get_files_refinery_applies() {
    let db = TestDb::new().await;
    let folder = Folder::new(&[
        (
            "V1__orders.sql",
            "CREATE TABLE orders (id int PRIMARY KEY);",
        ),
        (
            "later/V2__lines.sql",
            "CREATE TABLE lines (id int PRIMARY KEY);",
        ),
        ("notes.txt", ""),
    ]);
    let added = emit(&db, &folder, &["orders", "lines"]).await;
    assert_eq!(added, ["V3__guard_orders_lines.sql"]);
    refinery_run(&db, &folder.0).await.unwrap();
    assert_eq!(
        guarded(&db).await,
        [r#""public"."lines""#, r#""public"."orders""#]
    );
    let history: Vec<String> =
        sqlx::query_scalar("SELECT name FROM refinery_schema_history ORDER BY version")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(history, ["orders", "lines", "guard_orders_lines"]);

    // --migration-format refinery in an empty folder.
    let folder = Folder::new(&[]);
    let added = emit(&db, &folder, &["orders", "--migration-format", "refinery"]).await;
    assert_eq!(added, ["V1__guard_orders.sql"]);
}

/// A table whose name is SQL: emitted quoted, applied by both tools, nothing else touched.
#[tokio::test]
async fn hostile_table_names_are_quoted_in_emitted_migrations() {
    let name = r#"x'); DROP TABLE victim; --"#;
    let quoted = format!("\"{name}\"");
    for tool in ["sqlx", "refinery"] {
        let db = TestDb::new().await;
        db.exec(&format!(
            "CREATE TABLE victim (id int); CREATE TABLE {quoted} (id int);"
        ))
        .await;
        let folder = Folder::new(&[]);
        let added = emit(&db, &folder, &[&quoted, "--migration-format", tool]).await;
        assert!(
            added[0].ends_with("_guard_x____drop_table_victim____.sql"),
            "{added:?}"
        );
        if tool == "sqlx" {
            Migrator::new(folder.0.as_path())
                .await
                .unwrap()
                .run(&db.pool)
                .await
                .unwrap();
        } else {
            refinery_run(&db, &folder.0).await.unwrap();
        }
        assert_eq!(guarded(&db).await, [format!(r#""public".{quoted}"#)]);
        let victim: bool = sqlx::query_scalar("SELECT to_regclass('victim') IS NOT NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert!(victim, "{tool}: victim survives");
    }
}

/// Every bad input: one clear line, no file written, the database untouched.
#[tokio::test]
async fn bad_folders_and_table_lists_change_nothing() {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE orders (id int PRIMARY KEY); CREATE TABLE lines (id int)")
        .await;
    let mixed = Folder::new(&[
        ("0001_orders.sql", "SELECT 1;"),
        ("V1__orders.sql", "SELECT 1;"),
    ]);
    let sqlx_folder = Folder::new(&[("0001_orders.sql", "SELECT 1;")]);
    let refinery_folder = Folder::new(&[("V1__orders.sql", "SELECT 1;")]);
    let plain_file = Folder::new(&[("file.sql", "")]);
    let file_arg = plain_file.0.join("file.sql");
    let file_arg = file_arg.to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["orders", "--emit-migration", "/nonexistent/dir"],
            "cannot read migrations folder /nonexistent/dir",
        ),
        (vec!["orders", "--emit-migration", file_arg], "not a folder"),
        (
            vec!["orders", "--emit-migration", mixed.arg()],
            "holds files of two tools, sqlx-cli's (0001_orders.sql) and refinery's (V1__orders.sql)",
        ),
        (
            vec![
                "orders",
                "--emit-migration",
                mixed.arg(),
                "--migration-format",
                "sqlx",
            ],
            "holds files of two tools",
        ),
        (
            vec![
                "orders",
                "--emit-migration",
                sqlx_folder.arg(),
                "--migration-format",
                "refinery",
            ],
            "holds sqlx-cli migrations (0001_orders.sql)",
        ),
        (
            vec![
                "orders",
                "--emit-migration",
                refinery_folder.arg(),
                "--migration-format",
                "sqlx-reversible",
            ],
            "holds refinery migrations (V1__orders.sql)",
        ),
        (
            vec![
                "orders",
                "public.ORDERS",
                "--emit-migration",
                sqlx_folder.arg(),
            ],
            r#"table "public"."orders" is named twice ("orders" and "public.ORDERS")"#,
        ),
        (
            vec![
                "orders",
                "x\" ; DROP TABLE lines; --",
                "--emit-migration",
                sqlx_folder.arg(),
            ],
            "bad table name",
        ),
        (
            vec!["orders", "--migration-format", "refinery"],
            "required arguments were not provided: --emit-migration <DIR>",
        ),
        (
            vec![
                "orders",
                "--emit-migration",
                sqlx_folder.arg(),
                "--migration-format",
                "flyway",
            ],
            "invalid value 'flyway' for '--migration-format <TOOL>'",
        ),
        // Without --emit-migration: the database is not changed either.
        (vec!["orders", "lines", "orders"], "is named twice"),
        (vec!["orders", "a.b.c"], "bad table name"),
    ];
    let folders = [&mixed, &sqlx_folder, &refinery_folder, &plain_file];
    let files_before: Vec<_> = folders.iter().map(|f| f.files()).collect();
    let db_before = snapshot(&db).await;
    for (args, expected) in cases {
        let mut all = vec!["guard"];
        all.extend_from_slice(&args);
        let out = run(&db, &all).await;
        assert!(!out.status.success(), "{all:?} should fail");
        let err = text(&out.stderr);
        assert!(err.starts_with("pgfence: "), "{all:?}: {err}");
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{all:?}: one line: {err}"
        );
        assert!(err.contains(expected), "{all:?}: {err}");
        let files_now: Vec<_> = folders.iter().map(|f| f.files()).collect();
        assert_eq!(files_now, files_before, "{all:?}: no file written");
    }
    assert_eq!(
        snapshot(&db).await,
        db_before,
        "the database is not touched"
    );
}
