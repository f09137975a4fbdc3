//! `Repository::verify`: a declaration that does not match its table fails before the first
//! write, with an error naming the column — misspelled columns, a uuid key declared `String`,
//! a data column of the wrong type, an unguarded table, a key that is not unique.

use crate::support;

use pgfence::{Error, Repository, table::TableName};
use support::{TestDb, token};

#[derive(Debug, Clone, sqlx::FromRow, pgfence::FencedTable)]
#[fenced(table = "invoices")]
struct Invoice {
    #[fenced(key)]
    id: i64,
    status: String,
    amount: i64,
}

async fn db_with(sql: &str, guarded: &[&str]) -> TestDb {
    let db = TestDb::new().await;
    db.exec(sql).await;
    for table in guarded {
        pgfence::guard::guard(&db.pool, &TableName::parse(table).unwrap())
            .await
            .unwrap();
    }
    db
}

const INVOICES: &str =
    "CREATE TABLE invoices (id bigint PRIMARY KEY, status text NOT NULL, amount bigint NOT NULL)";

/// The reason of an `InvalidTable` error.
fn reason_of(err: Error) -> String {
    match err {
        Error::Invalid(pgfence::error::InvalidInput::Table { reason, .. }) => reason,
        other => panic!("expected InvalidTable, got {other:?}"),
    }
}

#[tokio::test]
async fn a_correct_declaration_passes_derived_or_declared() {
    let db = db_with(INVOICES, &["invoices"]).await;
    Repository::<Invoice>::new(db.pool.clone())
        .unwrap()
        .verify(&db.pool)
        .await
        .unwrap();

    #[derive(Clone)]
    struct Declared {
        id: i64,
        status: String,
    }
    pgfence::fenced_table!(Declared { table: "invoices", key: id: i64, columns: [status] });
    let repo = Repository::<Declared>::new(db.pool.clone()).unwrap();
    // Inside a transaction too.
    let mut tx = db.pool.begin().await.unwrap();
    repo.verify(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();
    let _never_written = Declared {
        id: 0,
        status: String::new(),
    };
}

#[derive(Clone)]
struct Misspelled {
    id: i64,
    stauts: String,
}

pgfence::fenced_table!(Misspelled { table: "invoices", key: id: i64, columns: [stauts] });

#[tokio::test]
async fn a_misspelled_column_is_named_before_the_first_write() {
    let db = db_with(INVOICES, &["invoices"]).await;
    let repo = Repository::<Misspelled>::new(db.pool.clone()).unwrap();
    let reason = reason_of(repo.verify(&db.pool).await.unwrap_err());
    assert_eq!(
        reason,
        "column \"stauts\" does not exist (did you mean \"status\"?)"
    );

    // Without verify, the first write is where it would have failed (42703).
    let row = Misspelled {
        id: 1,
        stauts: "paid".into(),
    };
    let err = repo.update(&db.pool, token(1), &row).await.unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("42703"), "{err:?}");
}

#[derive(Clone)]
struct Ticket {
    id: String,
    status: String,
}

pgfence::fenced_table!(Ticket { table: "tickets", key: id: String, columns: [status] });

#[tokio::test]
async fn a_uuid_key_declared_string_is_incompatible() {
    let db = db_with(
        "CREATE TABLE tickets (id uuid PRIMARY KEY, status text NOT NULL);
         INSERT INTO tickets VALUES ('6f1c1c52-3a53-4f3b-9d3c-0d6f4a0c9b11', 'open');",
        &["tickets"],
    )
    .await;
    let repo = Repository::<Ticket>::new(db.pool.clone()).unwrap();
    let reason = reason_of(repo.verify(&db.pool).await.unwrap_err());
    assert_eq!(
        reason,
        "key column \"id\" is uuid in the database but String in Rust (sqlx binds it as text)"
    );

    // Without verify: the first write fails with 42883 (no uuid = text operator).
    let row = Ticket {
        id: "6f1c1c52-3a53-4f3b-9d3c-0d6f4a0c9b11".into(),
        status: "closed".into(),
    };
    let err = repo.update(&db.pool, token(1), &row).await.unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("42883"), "{err:?}");
}

#[derive(Debug, Clone, sqlx::FromRow, pgfence::FencedTable)]
#[fenced(table = "invoices")]
struct NarrowAmount {
    #[fenced(key)]
    id: i64,
    #[sqlx(rename = "amount")]
    cents: i32,
}

#[tokio::test]
async fn the_derive_checks_data_column_types_too() {
    let db = db_with(INVOICES, &["invoices"]).await;
    let repo = Repository::<NarrowAmount>::new(db.pool.clone()).unwrap();
    let reason = reason_of(repo.verify(&db.pool).await.unwrap_err());
    assert_eq!(
        reason,
        "column \"amount\" is bigint in the database but i32 in Rust (sqlx binds it as int4)"
    );
}

#[tokio::test]
async fn an_unguarded_table_is_refused() {
    let db = db_with(INVOICES, &[]).await;
    let repo = Repository::<Invoice>::new(db.pool.clone()).unwrap();
    let reason = reason_of(repo.verify(&db.pool).await.unwrap_err());
    assert!(
        reason.contains("not guarded: no pgfence_guard trigger"),
        "{reason}"
    );
    assert!(
        reason.contains("column \"fence\" does not exist"),
        "{reason}"
    );

    // Guarded, then the trigger disabled for maintenance and left so.
    pgfence::guard::guard(&db.pool, &TableName::parse("invoices").unwrap())
        .await
        .unwrap();
    repo.verify(&db.pool).await.unwrap();
    db.exec("ALTER TABLE invoices DISABLE TRIGGER pgfence_guard")
        .await;
    let reason_disabled = reason_of(repo.verify(&db.pool).await.unwrap_err());
    assert!(
        reason_disabled.contains("pgfence_guard trigger is disabled"),
        "{reason_disabled}"
    );
}

#[tokio::test]
async fn a_missing_table_a_bad_fence_and_a_key_that_is_not_unique() {
    let db = db_with(
        "CREATE TABLE invoices (id bigint NOT NULL, status text, amount bigint, fence int)",
        &[],
    )
    .await;
    // A guard trigger by hand, on a table whose fence is not bigint (guard would refuse it).
    db.exec(
        "CREATE FUNCTION noop() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NEW; END';
         CREATE TRIGGER pgfence_guard BEFORE UPDATE ON invoices FOR EACH ROW EXECUTE FUNCTION noop();",
    )
    .await;
    let repo = Repository::<Invoice>::new(db.pool.clone()).unwrap();
    let reason = reason_of(repo.verify(&db.pool).await.unwrap_err());
    assert_eq!(
        reason,
        "column \"fence\" is integer; pgfence needs bigint NOT NULL; the key (id) is not a \
         primary key or unique index: a write could match several rows, and upsert's ON \
         CONFLICT needs one"
    );

    let other = Repository::<Invoice>::for_table(
        db.pool.clone(),
        TableName::parse("billing.invoices").unwrap(),
    )
    .unwrap();
    let err = other.verify(&db.pool).await.unwrap_err();
    assert!(
        matches!(err, Error::TableNotFound(ref t) if t == "\"billing\".\"invoices\""),
        "{err:?}"
    );
}

fn sqlstate(err: &Error) -> Option<String> {
    match err {
        Error::Backend(b) => b.sqlstate().map(str::to_owned),
        _ => None,
    }
}
