//! `pgfence guard` / `unguard`: bad table names change nothing, `--emit-migration`, the help's
//! file name, a busy table, SQL case folding of table names; the guard modes are in [`modes`].

use crate::common::exact_env::{ok, output};
use crate::common::urls::{one_error, pg_snapshot, pgfence};
use crate::common::{Cli, snapshot, text};
use crate::support;

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};

use support::{TestDb, redis_url};

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
        let line = help
            .lines()
            .find(|l| l.contains("--emit-migration"))
            .unwrap_or_else(|| panic!("no --emit-migration: {help}"));
        assert!(
            line.contains("V{n}__guard_<table>.sql"),
            "the file name is cut: {help}"
        );
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
