//! Conditional writes: the caller's own condition (an optimistic lock's `version = $n`) rides
//! the fenced write, and the outcome says which check refused it: the fence, the condition,
//! or no row.

use crate::support;

use pgfence::{Error, Repository, error::ErrorKind, repository::Condition, table::TableName};
use support::{TestDb, audit_count, token};

#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
struct Doc {
    id: i64,
    body: String,
    version: i64,
}

pgfence::fenced_table!(Doc { table: "docs", key: id: i64, columns: [body, version] });

fn doc(id: i64, body: &str, version: i64) -> Doc {
    Doc {
        id,
        body: body.into(),
        version,
    }
}

async fn setup() -> (TestDb, Repository<Doc>) {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE docs (id bigint PRIMARY KEY, body text NOT NULL, version bigint NOT NULL, \
         archived_at timestamptz);
         INSERT INTO docs VALUES (1, 'initial', 0, NULL), (2, 'other', 0, NULL);",
    )
    .await;
    pgfence::guard::guard(&db.pool, &TableName::parse("docs").unwrap())
        .await
        .unwrap();
    let repo = Repository::new(db.pool.clone()).unwrap();
    (db, repo)
}

async fn body(db: &TestDb, id: i64) -> Option<(String, i64)> {
    sqlx::query_as("SELECT body, version FROM docs WHERE id = $1")
        .bind(id)
        .fetch_optional(&db.pool)
        .await
        .unwrap()
}

fn version(v: i64) -> Condition {
    Condition::eq("version", v).unwrap()
}

/// The optimistic lock kept: a write whose version matches applies (and the same lease may go
/// on), one that read an older version is refused as the condition's, not audited, and the
/// row is untouched.
#[tokio::test]
async fn update_if_applies_only_where_the_condition_holds() {
    let (db, repo) = setup().await;
    repo.update_if(&db.pool, token(1), &doc(1, "first", 1), &version(0))
        .await
        .unwrap();
    assert_eq!(body(&db, 1).await, Some(("first".into(), 1)));

    // The same lease, with a copy read before its own write: version 0 is gone.
    let err = repo
        .update_if(&db.pool, token(1), &doc(1, "lost update", 1), &version(0))
        .await
        .unwrap_err();
    match &err {
        Error::ConditionFailed {
            table,
            key,
            operation,
            condition,
        } => {
            assert_eq!(table, "\"public\".\"docs\"");
            assert_eq!(key, "[1]");
            assert_eq!(*operation, "update");
            assert_eq!(condition, "\"version\" = $value");
        }
        other => panic!("expected ConditionFailed, got {other:?}"),
    }
    assert_eq!(err.kind(), ErrorKind::Conflict);
    assert!(!err.is_retryable() && !err.is_stale());
    assert!(err.to_string().contains("re-read"), "{err}");
    assert_eq!(body(&db, 1).await, Some(("first".into(), 1)));
    assert_eq!(
        audit_count(&db.pool).await,
        0,
        "a condition is not a rejection"
    );

    // Several tests, all of which must hold: one that does not refuses the write.
    let both = version(1).and(Condition::is_null("archived_at").unwrap());
    repo.update_if(&db.pool, token(1), &doc(1, "second", 2), &both)
        .await
        .unwrap();
    let archived = version(2).and(Condition::is_not_null("archived_at").unwrap());
    assert!(matches!(
        repo.update_if(&db.pool, token(1), &doc(1, "x", 3), &archived)
            .await,
        Err(Error::ConditionFailed { .. })
    ));
    assert_eq!(body(&db, 1).await, Some(("second".into(), 2)));
}

/// The fence is checked first: a newer lease's write refuses an older lease with
/// `StaleToken` (audited) whether its condition holds or not; a missing row is `NotFound`.
#[tokio::test]
async fn the_fence_wins_over_the_condition_and_a_missing_row_is_not_found() {
    let (db, repo) = setup().await;
    repo.update_if(&db.pool, token(5), &doc(1, "newer", 1), &version(0))
        .await
        .unwrap();
    for cond in [version(1), version(0)] {
        let err = repo
            .update_if(&db.pool, token(4), &doc(1, "zombie", 2), &cond)
            .await
            .unwrap_err();
        support::assert_stale(&err, 4, 5);
    }
    assert_eq!(audit_count(&db.pool).await, 2);
    assert_eq!(body(&db, 1).await, Some(("newer".into(), 1)));

    assert!(matches!(
        repo.update_if(&db.pool, token(5), &doc(9, "none", 1), &version(0))
            .await,
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(
        repo.delete_if(&db.pool, token(5), &9, &version(0)).await,
        Err(Error::NotFound { .. })
    ));
}

/// `delete_if` and `update_columns_if` carry the condition too; inside the caller's
/// transaction a refused condition leaves the transaction usable (nothing failed).
#[tokio::test]
async fn delete_if_and_update_columns_if_carry_the_condition() {
    let (db, repo) = setup().await;
    let mut tx = db.pool.begin().await.unwrap();
    assert!(matches!(
        repo.delete_if(&mut *tx, token(1), &2, &version(7)).await,
        Err(Error::ConditionFailed {
            operation: "delete",
            ..
        })
    ));
    repo.update_columns_if(
        &mut *tx,
        token(1),
        &doc(2, "only the body", 99),
        &["body"],
        &version(0),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(body(&db, 2).await, Some(("only the body".into(), 0)));
    assert!(matches!(
        repo.update_columns_if(&db.pool, token(1), &doc(2, "no", 0), &["body"], &version(3))
            .await,
        Err(Error::ConditionFailed { .. })
    ));

    repo.delete_if(&db.pool, token(1), &2, &version(0))
        .await
        .unwrap();
    assert_eq!(body(&db, 2).await, None);
    // The fenced delete's tombstone is there: an older lease cannot bring the row back.
    let tombstones: i64 = sqlx::query_scalar("SELECT count(*) FROM pgfence.tombstone")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(tombstones, 1);
}

/// A hostile column name is quoted, a hostile value is a bound value: neither becomes SQL.
#[tokio::test]
async fn hostile_names_and_values_stay_names_and_values() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE hostile (id bigint PRIMARY KEY, \"v'); DROP TABLE hostile; --\" text NOT NULL);
         INSERT INTO hostile VALUES (1, 'safe');",
    )
    .await;
    pgfence::guard::guard(&db.pool, &TableName::parse("hostile").unwrap())
        .await
        .unwrap();
    #[derive(Clone)]
    struct Hostile {
        id: i64,
        v: String,
    }
    impl pgfence::FencedTable for Hostile {
        type Key = i64;
        const TABLE: &'static str = "hostile";
        const KEY_COLUMNS: &'static [&'static str] = &["id"];
        const COLUMNS: &'static [&'static str] = &["v'); DROP TABLE hostile; --"];
        fn bind_key(&self, q: pgfence::table::PgQuery) -> pgfence::table::PgQuery {
            q.bind(self.id)
        }
        fn bind_columns(&self, q: pgfence::table::PgQuery) -> pgfence::table::PgQuery {
            q.bind(self.v.clone())
        }
        fn bind_key_value(key: &i64, q: pgfence::table::PgQuery) -> pgfence::table::PgQuery {
            q.bind(*key)
        }
    }
    let repo = Repository::<Hostile>::new(db.pool.clone()).unwrap();
    let column = "v'); DROP TABLE hostile; --";
    let sneaky = Condition::eq(column, "x' OR 'a' = 'a".to_owned()).unwrap();
    let row = Hostile {
        id: 1,
        v: "changed".into(),
    };
    assert!(matches!(
        repo.update_if(&db.pool, token(1), &row, &sneaky).await,
        Err(Error::ConditionFailed { .. })
    ));
    repo.update_if(
        &db.pool,
        token(1),
        &row,
        &Condition::eq(column, "safe".to_owned()).unwrap(),
    )
    .await
    .unwrap();
    let v: String = sqlx::query_scalar("SELECT \"v'); DROP TABLE hostile; --\" FROM hostile")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(v, "changed");
}
