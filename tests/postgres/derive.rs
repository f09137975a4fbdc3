//! `#[derive(FencedTable)]`: one struct reads rows (`sqlx::FromRow`) and declares the table
//! (renamed columns, a skipped field, a composite key); `fetch` reads without fencing;
//! `update_columns` writes only the named columns, fenced exactly like `update`.

use crate::support;

use pgfence::{
    Error, FencedTable, Fencing, Repository,
    repository::{RowOutcome, Upserted},
    table::{PgQuery, TableName},
};
use support::{TestDb, assert_stale, audit_count, token};

/// A ledger line: composite key, a column renamed for reads and writes, a field that is no
/// column at all, and the fence, read but never written.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow, pgfence::FencedTable)]
#[fenced(schema = "billing", table = "ledger_line")]
struct Line {
    #[fenced(key)]
    batch: i64,
    #[fenced(key)]
    line: i32,
    #[sqlx(rename = "amount_cents")]
    amount: i64,
    status: String,
    /// Not a column: never written, `Default` when read.
    #[fenced(skip)]
    #[sqlx(default)]
    note: Option<String>,
    /// Read by FromRow, written by pgfence only.
    #[fenced(skip)]
    #[sqlx(default)]
    fence: i64,
}

fn line(batch: i64, line: i32, amount: i64, status: &str) -> Line {
    Line {
        batch,
        line,
        amount,
        status: status.into(),
        note: None,
        fence: 0,
    }
}

async fn setup() -> (TestDb, Repository<Line>) {
    let db = TestDb::new().await;
    db.exec(
        "CREATE SCHEMA billing;
         CREATE TABLE billing.ledger_line (batch bigint, line int, amount_cents bigint NOT NULL,
             status text NOT NULL, PRIMARY KEY (batch, line));
         INSERT INTO billing.ledger_line VALUES (1, 1, 100, 'open'), (1, 2, 200, 'open'),
             (2, 1, 300, 'open');",
    )
    .await;
    pgfence::guard::guard(&db.pool, &TableName::parse("billing.ledger_line").unwrap())
        .await
        .unwrap();
    let repo = Repository::new(db.pool.clone()).unwrap();
    (db, repo)
}

#[test]
fn the_derive_declares_keys_in_field_order_and_columns_after_renames() {
    assert_eq!(Line::SCHEMA, "billing");
    assert_eq!(Line::TABLE, "ledger_line");
    assert_eq!(Line::KEY_COLUMNS, ["batch", "line"]);
    assert_eq!(Line::COLUMNS, ["amount_cents", "status"]);
    // The key's type comes from the fields, stated once.
    let key: <Line as FencedTable>::Key = (1_i64, 2_i32);
    assert_eq!(key, (1, 2));
    assert_eq!(Line::key_types().len(), 2);
    assert_eq!(Line::column_types()[0].rust_name(), "i64");
}

#[tokio::test]
async fn one_struct_claims_fetches_updates_and_batches() {
    let (db, repo) = setup().await;
    repo.verify(&db.pool).await.unwrap();
    let lease = Fencing::new(token(3)).holder("job");

    // Claim reads the row through FromRow: renamed column, skipped field defaulted.
    let mut first: Line = repo.claim(&db.pool, lease.clone(), &(1, 1)).await.unwrap();
    assert_eq!(
        (first.amount, first.status.as_str(), first.note.as_deref()),
        (100, "open", None)
    );
    assert_eq!(first.fence >> 24, 3, "the claimed fence is read back");

    // Update writes the renamed column; the skipped fields are not columns to write.
    first.amount = 150;
    first.status = "processing".into();
    first.note = Some("never written".into());
    repo.update(&db.pool, lease.clone(), &first).await.unwrap();
    let fetched: Line = repo.fetch(&db.pool, &(1, 1)).await.unwrap().unwrap();
    assert_eq!(
        (fetched.amount, fetched.status.as_str(), fetched.note),
        (150, "processing", None)
    );
    assert!(fetched.fence > first.fence, "the write advanced the fence");
    assert!(
        repo.fetch::<_, Line>(&db.pool, &(9, 9))
            .await
            .unwrap()
            .is_none()
    );

    // Batches bind the derived arrays: one update per row, in input order.
    let rows = vec![
        line(1, 2, 210, "paid"),
        line(2, 1, 310, "paid"),
        line(3, 1, 0, "x"),
    ];
    let outcome = repo
        .update_many(&db.pool, lease.clone(), &rows)
        .await
        .unwrap();
    assert_eq!(
        outcome.rows,
        [
            RowOutcome::Applied,
            RowOutcome::Applied,
            RowOutcome::NotFound
        ]
    );
    let second: Line = repo.fetch(&db.pool, &(2, 1)).await.unwrap().unwrap();
    assert_eq!((second.amount, second.status.as_str()), (310, "paid"));

    let claimed = repo
        .claim_many::<_, Line>(&db.pool, lease.clone(), &[(1, 2), (2, 1)])
        .await
        .unwrap();
    assert!(claimed.outcome.all_applied());
    assert_eq!(claimed.rows[0].as_ref().unwrap().amount, 210);

    assert_eq!(
        repo.upsert(&db.pool, lease.clone(), &line(3, 1, 5, "new"))
            .await
            .unwrap(),
        Upserted::Inserted
    );
    let deleted = repo
        .delete_many(&db.pool, lease.clone(), &[(3, 1)])
        .await
        .unwrap();
    assert!(deleted.all_applied());

    // A newer lease's write fences this one out, through the derived impl too.
    repo.update(&db.pool, token(4), &line(1, 1, 1, "taken"))
        .await
        .unwrap();
    let err = repo.update(&db.pool, lease, &first).await.unwrap_err();
    assert_stale(&err, 3, 4);
    assert_eq!(audit_count(&db.pool).await, 1);
}

#[derive(Debug, Clone, sqlx::FromRow)]
struct Invoice {
    id: i64,
    status: String,
    amount: i64,
}

pgfence::fenced_table!(Invoice { table: "invoices", key: id: i64, columns: [status, amount] });

async fn invoices() -> (TestDb, Repository<Invoice>) {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE invoices (id bigint PRIMARY KEY, status text NOT NULL, amount bigint NOT NULL);
         INSERT INTO invoices VALUES (1, 'open', 100);",
    )
    .await;
    pgfence::guard::guard(&db.pool, &TableName::parse("invoices").unwrap())
        .await
        .unwrap();
    let repo = Repository::new(db.pool.clone()).unwrap();
    (db, repo)
}

async fn stored(db: &TestDb) -> (String, i64, i64) {
    sqlx::query_as("SELECT status, amount, fence >> 24 FROM invoices WHERE id = 1")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn update_columns_writes_only_the_named_columns() {
    let (db, repo) = invoices().await;
    let job = Fencing::new(token(5)).holder("job");

    // The job reads the invoice...
    let mut invoice: Invoice = repo.fetch(&db.pool, &1).await.unwrap().unwrap();
    // ...someone else changes its amount meanwhile (an older lease, token 2, so the job's
    // lease is still admitted)...
    db.exec(
        "UPDATE invoices SET amount = 250, fence = pgfence.next_fence(fence, 2, 0) WHERE id = 1",
    )
    .await;
    // ...and the job sets the status only: the amount it read (100) is not written back.
    invoice.status = "paid".into();
    repo.update_columns(&db.pool, job.clone(), &invoice, &["status"])
        .await
        .unwrap();
    assert_eq!(stored(&db).await, ("paid".into(), 250, 5));

    // The same lease writes again (one lease, many writes), naming both columns.
    invoice.amount = 260;
    repo.update_columns(&db.pool, job.clone(), &invoice, &["amount", "status"])
        .await
        .unwrap();
    assert_eq!(stored(&db).await, ("paid".into(), 260, 5));

    // Whereas `update` writes every declared column, the stale amount included.
    let mut full = invoice.clone();
    full.amount = 100;
    repo.update(&db.pool, job.clone(), &full).await.unwrap();
    assert_eq!(stored(&db).await.1, 100);
}

#[tokio::test]
async fn update_columns_is_fenced_like_update() {
    let (db, repo) = invoices().await;
    let old = Fencing::new(token(5)).holder("zombie");
    let invoice = Invoice {
        id: 1,
        status: "paid".into(),
        amount: 1,
    };
    repo.update_columns(&db.pool, token(6), &invoice, &["amount"])
        .await
        .unwrap();

    // An older lease: stale, audited as an update, nothing written.
    let err = repo
        .update_columns(&db.pool, old, &invoice, &["status"])
        .await
        .unwrap_err();
    assert_stale(&err, 5, 6);
    assert_eq!(audit_count(&db.pool).await, 1);
    let audit = pgfence::audit::list(&db.pool, &Default::default())
        .await
        .unwrap();
    assert_eq!(
        (audit[0].operation.as_str(), audit[0].key.as_deref()),
        ("update", Some("[1]"))
    );
    assert_eq!(stored(&db).await, ("open".into(), 1, 6));

    // A missing row: not found.
    let ghost = Invoice { id: 2, ..invoice };
    let err = repo
        .update_columns(&db.pool, token(7), &ghost, &["status"])
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err:?}");

    // Unknown, key or no columns: refused before anything is sent.
    for columns in [&["stauts"][..], &["id"], &[]] {
        let err = repo
            .update_columns(&db.pool, token(7), &ghost, columns)
            .await
            .unwrap_err();
        match &err {
            Error::Invalid(pgfence::error::InvalidInput::Table { reason, .. }) => {
                if let [name] = columns {
                    assert!(reason.contains(&format!("\"{name}\"")), "{reason}");
                }
            }
            other => panic!("expected InvalidTable, got {other:?}"),
        }
    }
    assert_eq!(stored(&db).await, ("open".into(), 1, 6));
}

/// A hand-written impl that does not bind single columns.
struct Bare {
    id: i64,
    status: String,
}

impl FencedTable for Bare {
    type Key = i64;
    const TABLE: &'static str = "invoices";
    const KEY_COLUMNS: &'static [&'static str] = &["id"];
    const COLUMNS: &'static [&'static str] = &["status"];
    fn bind_key(&self, query: PgQuery) -> PgQuery {
        query.bind(self.id)
    }
    fn bind_columns(&self, query: PgQuery) -> PgQuery {
        query.bind(self.status.clone())
    }
    fn bind_key_value(key: &i64, query: PgQuery) -> PgQuery {
        query.bind(*key)
    }
}

#[tokio::test]
async fn a_hand_written_impl_without_bind_column_is_refused_before_sending() {
    let (db, _) = invoices().await;
    let repo = Repository::<Bare>::new(db.pool.clone()).unwrap();
    let row = Bare {
        id: 1,
        status: "paid".into(),
    };
    let err = repo
        .update_columns(&db.pool, token(5), &row, &["status"])
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Invalid(pgfence::error::InvalidInput::Table { reason, .. }) if reason.contains("bind_column")),
        "{err:?}"
    );
    // `update` still works, and verify passes without types (unchecked).
    repo.update(&db.pool, token(5), &row).await.unwrap();
    repo.verify(&db.pool).await.unwrap();
    assert_eq!(stored(&db).await.0, "paid");
}
