//! `pgfence guard` / `unguard`: bad table names change nothing, `--emit-migration`, the help's
//! file name, a busy table, several tables in one transaction, SQL case folding of table
//! names; the guard modes are in [`modes`], the emitted migrations applied by sqlx and
//! refinery in [`emit`].

use crate::common::exact_env::{ok, output};
use crate::common::urls::{one_error, pg_snapshot, pgfence};
use crate::common::{Cli, snapshot, text};
use crate::support;

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};

use support::{TestDb, redis_url};

mod emit;
mod modes;

#[tokio::test]
async fn bad_tables_change_nothing() {
    let db = TestDb::new().await;
    let cli = Cli::new(&db).await;
    db.exec(r#"CREATE TABLE victim (x int); CREATE TABLE "semi;colon" (id int);"#)
        .await;
    let before = snapshot(&db).await;
    for bad in [
        "no_such_table",
        "victim; DROP TABLE victim",
        "x\" ; DROP TABLE victim; --",
        "a.b.c",
        "\"unterminated",
        "",
    ] {
        let err = cli.fails(&["guard", bad]);
        assert!(
            err.contains("does not exist") || err.contains("bad table name"),
            "{bad}: {err}"
        );
    }
    let long = "t".repeat(64);
    assert!(
        cli.fails(&["guard", &long])
            .contains("longer than 63 bytes")
    );
    assert_eq!(snapshot(&db).await, before, "nothing changed");
    // A table whose name really contains a semicolon is guarded, by its exact name.
    assert!(cli.ok(&["guard", "semi;colon"]).contains("guarded"));
}

#[tokio::test]
async fn emit_migration_writes_the_next_version() {
    let db = TestDb::new().await;
    let cli = Cli::new(&db).await;
    let dir = std::env::temp_dir().join(format!("pgfence-mig-{}", rand::random::<u64>()));
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("V1__users.sql"), "CREATE TABLE users (id int);").unwrap();
    std::fs::write(dir.join("V7__orders.rs"), "").unwrap();
    std::fs::write(dir.join("README"), "").unwrap();
    let before = snapshot(&db).await;
    let out = cli.ok(&[
        "guard",
        "billing.\"Invoices\"",
        "--emit-migration",
        dir.to_str().unwrap(),
    ]);
    let path = dir.join("V8__guard_billing_invoices.sql");
    assert!(out.contains(path.to_str().unwrap()), "{out}");
    let sql = std::fs::read_to_string(&path).unwrap();
    assert!(
        sql.contains("SELECT pgfence.guard('billing', 'Invoices');"),
        "{sql}"
    );
    assert_eq!(snapshot(&db).await, before, "the database is not touched");

    // The emitted file does what guard does.
    db.exec(r#"CREATE SCHEMA billing; CREATE TABLE billing."Invoices" (id int);"#)
        .await;
    db.exec(&sql).await;
    assert!(cli.ok(&["tables"]).contains("\"billing\".\"Invoices\""));
    assert!(
        cli.fails(&["guard", "x", "--emit-migration", "/nonexistent/dir"])
            .contains("cannot read migrations folder")
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn guard_help_shows_the_migration_file_name_on_one_line() {
    for flag in ["--help", "-h"] {
        let help = ok(&output(&[], &["guard", flag]));
        let lines: Vec<&str> = help.lines().collect();
        let at = lines
            .iter()
            .position(|l| l.contains("--emit-migration <DIR>"))
            .unwrap_or_else(|| panic!("no --emit-migration: {help}"));
        // `-h` has the help on the flag's line, `--help` on the next one.
        let text = format!("{} {}", lines[at], lines.get(at + 1).unwrap_or(&""));
        for name in ["V{n}__guard_<table>.sql", "`<version>_guard_<table>.sql`"] {
            assert!(text.contains(name), "the file name is cut: {help}");
        }
        assert!(
            !help.contains('\x1b'),
            "escape codes in piped help: {help:?}"
        );
    }
}

/// An open transaction that wrote the table holds a lock that guard's DDL waits for: guard
/// gives up within `--lock-timeout` with a clear line, changes nothing, and succeeds once the
/// transaction ends. Same for unguard.
#[tokio::test]
async fn guard_and_unguard_give_up_on_a_busy_table() {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE victim (id int PRIMARY KEY, v text NOT NULL); INSERT INTO victim VALUES (1, 'a');")
        .await;
    let redis = redis_url().await;
    let mut holder = PgConnection::connect_with(&db.options).await.unwrap();
    sqlx::raw_sql("BEGIN; UPDATE victim SET v = 'b'")
        .execute(&mut holder)
        .await
        .unwrap();
    let before = pg_snapshot(&db.pool).await;
    let started = Instant::now();
    let out = pgfence(
        &db.url(),
        &redis,
        &["guard", "victim", "--lock-timeout", "600ms"],
    );
    let took = started.elapsed();
    let err = one_error(&out);
    assert!(
        err.contains("is busy") && err.contains("raise --lock-timeout"),
        "{err}"
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert_eq!(pg_snapshot(&db.pool).await, before, "nothing changed");
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .unwrap();
    let out = pgfence(&db.url(), &redis, &["guard", "victim"]);
    assert!(out.status.success(), "{}", text(&out.stderr));

    sqlx::raw_sql("BEGIN; UPDATE victim SET v = 'c', fence = pgfence.lease_fence(1, 0)")
        .execute(&mut holder)
        .await
        .unwrap();
    let started = Instant::now();
    let out = pgfence(
        &db.url(),
        &redis,
        &["unguard", "victim", "--lock-timeout", "300ms"],
    );
    assert!(one_error(&out).contains("is busy"));
    assert!(started.elapsed() < Duration::from_secs(5));
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .unwrap();
    let out = pgfence(&db.url(), &redis, &["unguard", "victim"]);
    assert!(
        text(&out.stdout).contains("unguarded"),
        "{}",
        text(&out.stderr)
    );
}

/// `guard MixedCase` guards `mixedcase`, as SQL would; `guard '"MixedCase"'` the quoted one.
#[tokio::test]
async fn unquoted_table_names_fold_to_lower_case() {
    let db = TestDb::new().await;
    db.exec(r#"CREATE TABLE mixedcase (id int); CREATE TABLE "MixedCase" (id int);"#)
        .await;
    let redis = redis_url().await;
    let out = pgfence(&db.url(), &redis, &["guard", "MixedCase"]);
    assert!(
        text(&out.stdout).contains(r#"guarded "public"."mixedcase""#),
        "{}",
        text(&out.stderr)
    );
    let tables = text(&pgfence(&db.url(), &redis, &["tables"]).stdout);
    let names: Vec<&str> = tables
        .lines()
        .map(|l| l.split('\t').next().unwrap_or(l).trim())
        .collect();
    assert_eq!(names, [r#""public"."mixedcase""#], "{tables}");
    let out = pgfence(&db.url(), &redis, &["guard", "\"MixedCase\""]);
    assert!(
        text(&out.stdout).contains(r#"guarded "public"."MixedCase""#),
        "{}",
        text(&out.stderr)
    );
    let out = pgfence(&db.url(), &redis, &["unguard", "PUBLIC.MIXEDCASE"]);
    assert!(text(&out.stdout).contains(r#"unguarded "public"."mixedcase""#));
}

/// Several tables in one call are one transaction: all guarded, or, when one of them does
/// not exist or stays busy, none (the others' `fence` columns and triggers rolled back).
/// `unguard` likewise.
#[tokio::test]
async fn several_tables_change_in_one_transaction() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE victim (id int PRIMARY KEY, v text NOT NULL); INSERT INTO victim VALUES (1, 'a');
         CREATE TABLE orders (id int PRIMARY KEY); CREATE TABLE lines (id int PRIMARY KEY);",
    )
    .await;
    let redis = redis_url().await;
    let before = pg_snapshot(&db.pool).await;
    let err = one_error(&pgfence(
        &db.url(),
        &redis,
        &["guard", "orders", "lines", "no_such_table"],
    ));
    assert!(
        err.contains("nothing was changed (the 3 tables are guarded in one transaction")
            && err.contains("no_such_table does not exist"),
        "{err}"
    );
    assert_eq!(
        pg_snapshot(&db.pool).await,
        before,
        "orders, lines untouched"
    );

    // The last table busy: the first is rolled back with it.
    let mut holder = PgConnection::connect_with(&db.options).await.unwrap();
    sqlx::raw_sql("BEGIN; UPDATE victim SET v = 'b'")
        .execute(&mut holder)
        .await
        .unwrap();
    let err = one_error(&pgfence(
        &db.url(),
        &redis,
        &["guard", "orders", "victim", "--lock-timeout", "300ms"],
    ));
    assert!(
        err.contains(r#"table "public"."victim" is busy"#) && err.contains("nothing was changed"),
        "{err}"
    );
    assert_eq!(pg_snapshot(&db.pool).await, before, "orders untouched");
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .unwrap();

    let out = pgfence(&db.url(), &redis, &["guard", "orders", "lines", "victim"]);
    assert_eq!(
        text(&out.stdout),
        "guarded \"public\".\"orders\" (enforce)\nguarded \"public\".\"lines\" (enforce)\nguarded \"public\".\"victim\" (enforce)\n",
        "{}",
        text(&out.stderr)
    );
    let out = pgfence(&db.url(), &redis, &["guard", "orders", "lines"]);
    assert!(text(&out.stdout).contains("\"public\".\"orders\" was already guarded"));
    let guarded = pg_snapshot(&db.pool).await;

    let err = one_error(&pgfence(
        &db.url(),
        &redis,
        &["unguard", "orders", "no_such_table", "--drop-column"],
    ));
    assert!(
        err.contains("nothing was changed (the 2 tables are unguarded"),
        "{err}"
    );
    assert_eq!(pg_snapshot(&db.pool).await, guarded, "orders still guarded");
    let err = one_error(&pgfence(&db.url(), &redis, &["unguard", "lines", "LINES"]));
    assert!(err.contains("is named twice"), "{err}");
    let out = pgfence(
        &db.url(),
        &redis,
        &["unguard", "orders", "lines", "--drop-column"],
    );
    assert_eq!(
        text(&out.stdout),
        "unguarded \"public\".\"orders\"\nunguarded \"public\".\"lines\"\n",
        "{}",
        text(&out.stderr)
    );
    let tables = text(&pgfence(&db.url(), &redis, &["tables"]).stdout);
    assert_eq!(tables, "\"public\".\"victim\"\tenforce\n");
}
