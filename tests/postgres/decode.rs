//! Errors change nothing: a claim (single and batch) whose row cannot be decoded into the
//! caller's type leaves the row as it was, and says which column and type.

use crate::support;

use pgfence::{Error, Fencing, Repository, Resource, table::TableName};
use support::{TestDb, token};

/// The table: a `bigint` key, a text column, an int column.
async fn setup() -> TestDb {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE invoices (id bigint PRIMARY KEY, status text NOT NULL, amount int NOT NULL);
         INSERT INTO invoices VALUES (1, 'open', 10), (2, 'open', 20);",
    )
    .await;
    pgfence::guard::guard(&db.pool, &TableName::parse("invoices").unwrap())
        .await
        .unwrap();
    db
}

async fn fences(db: &TestDb) -> Vec<i64> {
    sqlx::query_scalar("SELECT fence FROM invoices ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

fn lease() -> Fencing {
    Fencing::new(token(3))
        .resource(Resource::new("invoices:1").unwrap())
        .holder("job")
}

#[derive(Debug, Clone, sqlx::FromRow)]
struct Invoice {
    id: i64,
    status: String,
    amount: i32,
}
pgfence::fenced_table!(Invoice { table: "invoices", key: id: i64, columns: [status, amount] });

/// A typo'd column name.
#[derive(Debug, sqlx::FromRow)]
#[allow(dead_code)]
struct Typo {
    id: i64,
    statuss: String,
}

/// A value of the wrong type (`amount` is `int`, read as text).
#[derive(Debug, sqlx::FromRow)]
#[allow(dead_code)]
struct WrongValue {
    id: i64,
    amount: String,
}

/// The key of the wrong type: the table's key is `bigint`, declared `i32` here.
#[derive(Debug, Clone, sqlx::FromRow)]
#[allow(dead_code)]
struct NarrowKey {
    id: i32,
    status: String,
}
pgfence::fenced_table!(NarrowKey { table: "invoices", key: id: i32, columns: [status] });

/// A declaration with a typo'd column, for writes.
#[derive(Debug, Clone)]
struct TypoWrite {
    id: i64,
    statuss: String,
}
pgfence::fenced_table!(TypoWrite { table: "invoices", key: id: i64, columns: [statuss] });

/// A declaration whose value has the wrong type (`amount` is `int`).
#[derive(Debug, Clone)]
struct WrongWrite {
    id: i64,
    amount: String,
}
pgfence::fenced_table!(WrongWrite { table: "invoices", key: id: i64, columns: [amount] });

#[track_caller]
fn assert_decode(err: &Error, column: &str) {
    assert!(matches!(err, Error::Decode { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains(column), "{text}");
    assert!(text.contains("nothing changed"), "{text}");
    assert!(!text.contains(" at line "), "{text}");
}

#[track_caller]
fn assert_type_mismatch(err: &Error) {
    let text = err.to_string();
    match err {
        Error::Decode { .. } => assert!(text.contains("\"id\""), "{text}"),
        _ => assert!(
            text.contains("Rust type") && text.contains("does not match"),
            "{err:?}"
        ),
    }
    assert!(!text.contains(" at line "), "{text}");
}

#[tokio::test]
async fn a_claim_that_does_not_decode_changes_nothing() {
    let db = setup().await;
    let repo = Repository::<Invoice>::new(db.pool.clone()).unwrap();
    let before = fences(&db).await;
    assert_eq!(before, [0, 0]);

    // Single claims, on a pool and inside a caller's transaction.
    let err = repo
        .claim::<_, Typo>(&db.pool, lease(), &1)
        .await
        .unwrap_err();
    assert_decode(&err, "statuss");
    let err = repo
        .claim::<_, WrongValue>(&db.pool, lease(), &1)
        .await
        .unwrap_err();
    assert_decode(&err, "amount");
    let mut tx = db.pool.begin().await.unwrap();
    let err = repo
        .claim::<_, Typo>(&mut *tx, lease(), &1)
        .await
        .unwrap_err();
    assert_decode(&err, "statuss");
    // The caller's transaction goes on (the claim was a savepoint) and can commit.
    tx.commit().await.unwrap();
    // The key declared `i32` for a `bigint` column: refused (by the server when the
    // statement was prepared for `bigint` on this connection, or when decoding `id`), saying
    // the types do not match.
    // (Its own pool: sqlx caches a statement per connection with the parameter types of its
    // first use, and the two declarations send the same statement text.)
    let narrow_pool = db.pool(2).await;
    let narrow = Repository::<NarrowKey>::new(narrow_pool.clone()).unwrap();
    for _ in 0..3 {
        let err = narrow
            .claim::<_, NarrowKey>(&narrow_pool, lease(), &1)
            .await
            .unwrap_err();
        assert_type_mismatch(&err);
    }

    // Batch claims.
    let err = repo
        .claim_many::<_, Typo>(&db.pool, lease(), &[1, 2])
        .await
        .unwrap_err();
    assert_decode(&err, "statuss");
    let err = narrow
        .claim_many::<_, NarrowKey>(&narrow_pool, lease(), &[1, 2])
        .await
        .unwrap_err();
    assert_type_mismatch(&err);
    assert_eq!(fences(&db).await, before, "no failed claim changed a fence");

    // The other write APIs with the same shapes: refused by the server before anything is
    // written, and no fence moves.
    let typo = Repository::<TypoWrite>::new(db.pool.clone()).unwrap();
    let row = TypoWrite {
        id: 1,
        statuss: "paid".into(),
    };
    assert!(typo.update(&db.pool, lease(), &row).await.is_err());
    assert!(typo.upsert(&db.pool, lease(), &row).await.is_err());
    assert!(typo.update_many(&db.pool, lease(), &[row]).await.is_err());
    let wrong = Repository::<WrongWrite>::new(db.pool.clone()).unwrap();
    let row = WrongWrite {
        id: 1,
        amount: "ten".into(),
    };
    let err = wrong.update(&db.pool, lease(), &row).await.unwrap_err();
    assert!(!err.to_string().contains(" at line "), "{err}");
    assert!(wrong.upsert(&db.pool, lease(), &row).await.is_err());
    assert_eq!(fences(&db).await, before, "no failed write changed a fence");

    // The same claims with the right type apply.
    let got: Invoice = repo.claim(&db.pool, lease(), &1).await.unwrap();
    assert_eq!((got.id, got.status.as_str(), got.amount), (1, "open", 10));
    let many = repo
        .claim_many::<_, Invoice>(&db.pool, lease(), &[1, 2])
        .await
        .unwrap();
    assert!(many.rows.iter().all(Option::is_some));
    assert!(fences(&db).await.iter().all(|f| *f >> 24 == 3));
}
