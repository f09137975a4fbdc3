//! The typed repository against a real PostgreSQL: the seed's race, outcome classification,
//! upsert/delete fencing, the trigger's SQLSTATE mapping, hostile identifiers.

use crate::support;

use pgfence::{
    Error, FenceToken, Fencing, Repository, Resource,
    repository::{RowOutcome, Upserted},
    table::TableName,
    token::{Relation, StoredFence},
};
use support::{Logs, TestDb, audit_count, token};

#[derive(Debug, Clone, PartialEq)]
struct Snapshot {
    sku: String,
    payload: String,
    qty: i32,
}

pgfence::fenced_table!(Snapshot { table: "inventory_snapshot", key: sku: String, columns: [payload, qty] });

fn snap(sku: &str, payload: &str) -> Snapshot {
    Snapshot {
        sku: sku.into(),
        payload: payload.into(),
        qty: 1,
    }
}

async fn setup() -> (TestDb, Repository<Snapshot>) {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE inventory_snapshot (sku text PRIMARY KEY, payload text NOT NULL, qty int NOT NULL);
             INSERT INTO inventory_snapshot VALUES ('A-1', 'initial', 0);")
        .await;
    pgfence::guard::guard(&db.pool, &TableName::parse("inventory_snapshot").unwrap())
        .await
        .unwrap();
    let repo = Repository::new(db.pool.clone()).unwrap();
    (db, repo)
}

async fn row(db: &TestDb, sku: &str) -> Option<(String, i64)> {
    // The token of the lease that last wrote the row (the fence packs token, tag, sequence).
    sqlx::query_as("SELECT payload, fence >> 24 FROM inventory_snapshot WHERE sku = $1")
        .bind(sku)
        .fetch_optional(&db.pool)
        .await
        .unwrap()
}

/// The seed's practice scenario: A (token 1) reads and pauses; B (token 2) writes; A writes.
#[tokio::test]
async fn seed_race_stale_holder_is_rejected_audited_and_logged() {
    let (logs, _guard) = Logs::capture();
    let (db, repo) = setup().await;
    let resource = Resource::new("inventory:A-1").unwrap();

    // A takes token 1, opens its transaction and reads.
    let mut a_tx = db.pool.begin().await.unwrap();
    let seen: String =
        sqlx::query_scalar("SELECT payload FROM inventory_snapshot WHERE sku = 'A-1'")
            .fetch_one(&mut *a_tx)
            .await
            .unwrap();
    assert_eq!(seen, "initial");

    // A "pauses"; its lease expires; B gets token 2 and writes.
    repo.update(&db.pool, token(2), &snap("A-1", "written by B"))
        .await
        .unwrap();

    // A wakes up and writes with token 1.
    let a = Fencing::new(token(1))
        .resource(resource.clone())
        .holder("worker-a");
    let err = repo
        .update(&mut *a_tx, a, &snap("A-1", "written by A"))
        .await
        .unwrap_err();
    match &err {
        Error::StaleToken {
            presented, current, ..
        } => assert_eq!((*presented, *current), (1, 2)),
        other => panic!("expected StaleToken, got {other:?}"),
    }
    assert!(err.is_stale() && !err.is_retryable());
    a_tx.rollback().await.unwrap();

    // B's data is intact.
    assert_eq!(row(&db, "A-1").await, Some(("written by B".into(), 2)));

    // The audit row survived A's rollback.
    let audit = pgfence::audit::list(&db.pool, &Default::default())
        .await
        .unwrap();
    assert_eq!(audit.len(), 1);
    let entry = &audit[0];
    assert_eq!(entry.presented, 1);
    assert_eq!(entry.current, Some(2));
    assert_eq!(entry.resource.as_deref(), Some("inventory:A-1"));
    assert_eq!(entry.holder.as_deref(), Some("worker-a"));
    assert_eq!(
        entry.table.as_deref(),
        Some("\"public\".\"inventory_snapshot\"")
    );
    assert_eq!(entry.key.as_deref(), Some("[\"A-1\"]"));
    assert_eq!(entry.operation, "update");

    // And one WARN event with the stable target and fields was emitted.
    let warns = logs.with(pgfence::audit::LOG_TARGET, "WARN");
    assert_eq!(warns.len(), 1, "{:?}", logs.events());
    let fields = &warns[0]["fields"];
    assert_eq!(fields["presented"], 1);
    assert_eq!(fields["current"], 2);
    assert_eq!(fields["resource"], "inventory:A-1");
    assert_eq!(fields["holder"], "worker-a");
    assert_eq!(fields["key"], "[\"A-1\"]");
    assert_eq!(fields["operation"], "update");
    assert_eq!(fields["table"], "\"public\".\"inventory_snapshot\"");
}

#[tokio::test]
async fn missing_row_is_not_found_and_stale_row_is_stale() {
    let (db, repo) = setup().await;

    let err = repo
        .update(&db.pool, token(5), &snap("nope", "x"))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::NotFound { ref key, .. } if key == "[\"nope\"]"),
        "{err:?}"
    );
    let err = repo
        .delete(&db.pool, token(5), &"nope".to_owned())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err:?}");
    assert_eq!(
        audit_count(&db.pool).await,
        0,
        "not-found is not a rejection"
    );

    repo.update(&db.pool, token(7), &snap("A-1", "seven"))
        .await
        .unwrap();
    let err = repo
        .update(&db.pool, token(3), &snap("A-1", "three"))
        .await
        .unwrap_err();
    support::assert_stale(&err, 3, 7);

    // The same lease again: one lease is a session of work, its second write is applied.
    repo.update(&db.pool, token(7), &snap("A-1", "seven again"))
        .await
        .unwrap();
    assert_eq!(row(&db, "A-1").await, Some(("seven again".into(), 7)));
    assert_eq!(audit_count(&db.pool).await, 1);
}

#[tokio::test]
async fn upsert_inserts_then_fences_and_delete_tombstones_the_row() {
    let (db, repo) = setup().await;

    assert_eq!(
        repo.upsert(&db.pool, token(1), &snap("B-2", "one"))
            .await
            .unwrap(),
        Upserted::Inserted
    );
    assert_eq!(
        repo.upsert(&db.pool, token(3), &snap("B-2", "three"))
            .await
            .unwrap(),
        Upserted::Updated
    );
    let err = repo
        .upsert(&db.pool, token(2), &snap("B-2", "two"))
        .await
        .unwrap_err();
    support::assert_stale(&err, 2, 3);
    assert_eq!(row(&db, "B-2").await, Some(("three".into(), 3)));

    // Delete is fenced.
    let err = repo
        .delete(&db.pool, token(2), &"B-2".to_owned())
        .await
        .unwrap_err();
    support::assert_stale(&err, 2, 3);
    assert!(row(&db, "B-2").await.is_some());
    repo.delete(&db.pool, token(5), &"B-2".to_owned())
        .await
        .unwrap();
    assert!(row(&db, "B-2").await.is_none());

    // A stale holder (token 4 < 5) cannot resurrect it...
    let err = repo
        .upsert(&db.pool, token(4), &snap("B-2", "zombie"))
        .await
        .unwrap_err();
    support::assert_stale(&err, 4, 5);
    assert!(row(&db, "B-2").await.is_none());
    // ...but the lease that deleted it may insert it again, and a newer one may update it.
    assert_eq!(
        repo.upsert(&db.pool, token(5), &snap("B-2", "again"))
            .await
            .unwrap(),
        Upserted::Inserted
    );
    assert_eq!(
        repo.upsert(&db.pool, token(6), &snap("B-2", "six"))
            .await
            .unwrap(),
        Upserted::Updated
    );
    assert_eq!(row(&db, "B-2").await, Some(("six".into(), 6)));

    let ops: Vec<String> = sqlx::query_scalar("SELECT operation FROM pgfence.audit ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(ops, ["upsert", "delete", "upsert"]);
}

#[tokio::test]
async fn raw_sql_that_does_not_advance_the_fence_fails_with_the_documented_sqlstate() {
    let (db, repo) = setup().await;
    repo.update(&db.pool, token(10), &snap("A-1", "ten"))
        .await
        .unwrap();

    // An UPDATE that leaves the fence as it was is a lease-less write (PF007), not a stale
    // one: it names no lease.
    for sql in [
        "UPDATE inventory_snapshot SET payload = 'raw' WHERE sku = 'A-1'", // keeps the fence
        "UPDATE inventory_snapshot SET payload = 'raw', fence = fence WHERE sku = 'A-1'", // equal
    ] {
        let err = sqlx::query(sql).execute(&db.pool).await.unwrap_err();
        let code = err
            .as_database_error()
            .and_then(|e| e.code())
            .map(|c| c.into_owned());
        assert_eq!(
            code.as_deref(),
            Some(pgfence::error::sqlstate::LEASELESS),
            "{sql}"
        );
        match Error::from(err) {
            Error::LeaselessWrite { table, old, new } => {
                assert_eq!(old, new);
                assert_eq!(table, "\"public\".\"inventory_snapshot\"");
            }
            other => panic!("{sql}: expected LeaselessWrite, got {other:?}"),
        }
    }
    // One that lowers it (here to a bare token, 9) is stale: PF001.
    let sql = "UPDATE inventory_snapshot SET payload = 'raw', fence = 9 WHERE sku = 'A-1'";
    let err = sqlx::query(sql).execute(&db.pool).await.unwrap_err();
    let code = err
        .as_database_error()
        .and_then(|e| e.code())
        .map(|c| c.into_owned());
    assert_eq!(
        code.as_deref(),
        Some(pgfence::error::sqlstate::STALE),
        "{sql}"
    );
    match Error::from(err) {
        Error::StaleToken {
            current: 10,
            presented: 0,
            target,
            ..
        } => {
            assert_eq!(
                target,
                pgfence::error::StaleTarget::Table("\"public\".\"inventory_snapshot\"".into())
            );
        }
        other => panic!("{sql}: expected StaleToken, got {other:?}"),
    }
}

/// Many holders racing on one row: the highest token wins; every loser is classified stale
/// with the fence it lost to (never "not found", never a fence below its own token).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writers_are_classified_stale_against_the_winner() {
    let (db, repo) = setup().await;
    let mut tasks = Vec::new();
    for t in 1..=40 {
        let (repo, pool) = (repo.clone(), db.pool.clone());
        tasks.push(tokio::spawn(async move {
            (
                t,
                repo.update(&pool, token(t), &snap("A-1", &format!("t{t}")))
                    .await,
            )
        }));
    }
    let mut applied = 0;
    for task in tasks {
        let (t, outcome) = task.await.unwrap();
        match outcome {
            Ok(()) => applied += 1,
            Err(Error::StaleToken {
                presented, current, ..
            }) => {
                assert_eq!(presented, t);
                assert!(current > presented, "token {t} lost to {current}");
            }
            Err(other) => panic!("token {t}: unexpected {other:?}"),
        }
    }
    assert!(applied >= 1);
    assert_eq!(row(&db, "A-1").await, Some(("t40".into(), 40)));
    assert_eq!(audit_count(&db.pool).await, 40 - applied);
}

#[derive(Debug, Clone)]
struct Line {
    batch: i64,
    line: i32,
    amount: i64,
}

pgfence::fenced_table!(Line { schema: "billing", table: "ledger_line", key: (batch: i64, line: i32), columns: [amount] });

#[tokio::test]
async fn composite_keys_and_schemas() {
    let db = TestDb::new().await;
    db.exec("CREATE SCHEMA billing; CREATE TABLE billing.ledger_line (batch bigint, line int, amount bigint, PRIMARY KEY (batch, line));").await;
    pgfence::guard::guard(&db.pool, &TableName::parse("billing.ledger_line").unwrap())
        .await
        .unwrap();
    let repo = Repository::<Line>::new(db.pool.clone()).unwrap();

    let l = Line {
        batch: 42,
        line: 1,
        amount: 100,
    };
    assert_eq!(
        repo.upsert(&db.pool, token(2), &l).await.unwrap(),
        Upserted::Inserted
    );
    let err = repo
        .update(
            &db.pool,
            token(1),
            &Line {
                amount: 5,
                ..l.clone()
            },
        )
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        Error::StaleToken {
            presented: 1,
            current: 2,
            ..
        }
    ));
    let err = repo
        .update(
            &db.pool,
            token(3),
            &Line {
                line: 2,
                ..l.clone()
            },
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::NotFound { ref key, .. } if key == "[42, 2]"),
        "{err:?}"
    );
    repo.delete(&db.pool, token(3), &(42, 1)).await.unwrap();
    assert!(
        repo.upsert(&db.pool, token(2), &l)
            .await
            .unwrap_err()
            .is_stale()
    );
}

/// A table and columns named to break naive SQL: quoting must make them plain names.
struct Hostile {
    id: i32,
    value: String,
}

impl pgfence::FencedTable for Hostile {
    type Key = i32;
    const TABLE: &'static str = "weird\"; DROP TABLE victim; --";
    const KEY_COLUMNS: &'static [&'static str] = &["id\" = id OR 1=1 --"];
    const COLUMNS: &'static [&'static str] = &["välue 'quoted'"];
    fn bind_key(&self, q: pgfence::table::PgQuery) -> pgfence::table::PgQuery {
        q.bind(self.id)
    }
    fn bind_columns(&self, q: pgfence::table::PgQuery) -> pgfence::table::PgQuery {
        q.bind(&self.value)
    }
    fn bind_key_value(key: &i32, q: pgfence::table::PgQuery) -> pgfence::table::PgQuery {
        q.bind(*key)
    }
}

#[tokio::test]
async fn hostile_identifiers_are_quoted_not_executed() {
    let db = TestDb::new().await;
    db.exec(
        r#"CREATE TABLE victim (x int); INSERT INTO victim VALUES (1);
           CREATE TABLE "weird""; DROP TABLE victim; --" ("id"" = id OR 1=1 --" int PRIMARY KEY, "välue 'quoted'" text);
           INSERT INTO "weird""; DROP TABLE victim; --" VALUES (1, 'a'), (2, 'b');"#,
    )
    .await;
    let table = TableName::new("public", Hostile::TABLE_NAME).unwrap();
    assert!(pgfence::guard::guard(&db.pool, &table).await.unwrap());
    let repo = Repository::<Hostile>::new(db.pool.clone()).unwrap();
    repo.update(
        &db.pool,
        token(3),
        &Hostile {
            id: 1,
            value: "z".into(),
        },
    )
    .await
    .unwrap();
    let err = repo
        .update(
            &db.pool,
            token(1),
            &Hostile {
                id: 1,
                value: "y".into(),
            },
        )
        .await
        .unwrap_err();
    assert!(err.is_stale());
    repo.delete(&db.pool, token(2), &2).await.unwrap();

    let victims: i64 = sqlx::query_scalar("SELECT count(*) FROM victim")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(victims, 1, "victim table untouched");
    let rows: Vec<(i32, String, i64)> =
        sqlx::query_as(r#"SELECT "id"" = id OR 1=1 --", "välue 'quoted'", fence >> 24 FROM "weird""; DROP TABLE victim; --" ORDER BY 1"#)
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        rows,
        vec![(1, "z".to_owned(), 3)],
        "only row 1 updated, only row 2 deleted"
    );
}

impl Hostile {
    const TABLE_NAME: &'static str = <Hostile as pgfence::FencedTable>::TABLE;
}

struct Overlong;
impl pgfence::FencedTable for Overlong {
    type Key = i32;
    const TABLE: &'static str =
        "a_table_name_that_is_much_longer_than_sixty_three_bytes_and_would_be_truncated";
    const KEY_COLUMNS: &'static [&'static str] = &["id"];
    const COLUMNS: &'static [&'static str] = &[];
    fn bind_key(&self, q: pgfence::table::PgQuery) -> pgfence::table::PgQuery {
        q
    }
    fn bind_columns(&self, q: pgfence::table::PgQuery) -> pgfence::table::PgQuery {
        q
    }
    fn bind_key_value(_: &i32, q: pgfence::table::PgQuery) -> pgfence::table::PgQuery {
        q
    }
}

struct DeclaresFence;
impl pgfence::FencedTable for DeclaresFence {
    type Key = i32;
    const TABLE: &'static str = "t";
    const KEY_COLUMNS: &'static [&'static str] = &["id"];
    const COLUMNS: &'static [&'static str] = &["fence"];
    fn bind_key(&self, q: pgfence::table::PgQuery) -> pgfence::table::PgQuery {
        q
    }
    fn bind_columns(&self, q: pgfence::table::PgQuery) -> pgfence::table::PgQuery {
        q
    }
    fn bind_key_value(_: &i32, q: pgfence::table::PgQuery) -> pgfence::table::PgQuery {
        q
    }
}

#[tokio::test]
async fn bad_declarations_and_tokens_are_typed_errors() {
    let db = TestDb::new().await;
    assert!(matches!(
        Repository::<Overlong>::new(db.pool.clone()),
        Err(Error::Invalid(
            pgfence::error::InvalidInput::Identifier { .. }
        ))
    ));
    assert!(matches!(
        Repository::<DeclaresFence>::new(db.pool.clone()),
        Err(Error::Invalid(pgfence::error::InvalidInput::Table { .. }))
    ));
    assert!(
        matches!(FenceToken::new(0), Err(Error::Invalid(pgfence::error::InvalidInput::Token(ref t))) if t == "0")
    );
    assert!(
        matches!(FenceToken::new(-1), Err(Error::Invalid(pgfence::error::InvalidInput::Token(ref t))) if t == "-1")
    );
    assert!(matches!(
        TableName::parse("bad\0name"),
        Err(Error::Invalid(
            pgfence::error::InvalidInput::Identifier { .. }
        ))
    ));
    assert_eq!(audit_count(&db.pool).await, 0);
}

#[derive(Debug, Clone)]
struct Probe {
    id: i32,
    v: i32,
}

pgfence::fenced_table!(Probe { table: "layout_probe", key: id: i32, columns: [v] });

/// Fences around `lease` and at the layout's corners: older, this lease's cycle and seal, the
/// same token with another holder or counter, newer, the largest token.
fn fences_around(lease: &Fencing) -> Vec<StoredFence> {
    let mine = StoredFence::from_raw(lease.lease_fence());
    let token = lease.token.get();
    let mut fences = vec![
        StoredFence::from_raw(0),
        StoredFence::from_raw(42),
        mine,
        mine.next().unwrap(),
        mine.next().unwrap().next().unwrap(),
        StoredFence::from_raw(mine.get() + 4094),
        mine.sealed(),
        StoredFence::from_raw(pgfence::token::MAX_TOKEN << StoredFence::TOKEN_SHIFT),
        StoredFence::from_raw(i64::MAX),
    ];
    for tag in [
        0_u16,
        0xFF,
        0x100,
        0xFFF,
        mine.tag() ^ 1,
        mine.tag() ^ 0x100,
    ] {
        for t in [token - 1, token, token + 1] {
            if let Ok(t) = FenceToken::new(t) {
                let other = StoredFence::lease(t, tag);
                fences.extend([other, other.next().unwrap(), other.sealed()]);
            }
        }
    }
    fences.sort();
    fences.dedup();
    fences
}

/// The repository's statements (single-row and batch, generated from StoredFence's constants)
/// decide every corner fence exactly as Fencing::classify does, and store StoredFence::next.
#[tokio::test]
async fn the_generated_statements_decide_like_the_rust_layout() {
    let db = TestDb::new().await;
    // Not guarded: fences are set by hand here, and the repository needs only the column.
    db.exec("CREATE TABLE layout_probe (id int PRIMARY KEY, v int NOT NULL, fence bigint NOT NULL DEFAULT 0)")
        .await;
    let repo = Repository::<Probe>::new(db.pool.clone()).unwrap();
    let leases = [
        Fencing::new(token(1)).holder("a"),
        Fencing::new(token(2)).holder("b"),
        Fencing::new(token(77))
            .holder("c")
            .resource(Resource::in_domain("billing", "account:1").unwrap()),
        Fencing::new(FenceToken::new(pgfence::token::MAX_TOKEN).unwrap()).holder("d"),
    ];
    for lease in &leases {
        let fences = fences_around(lease);
        let ids: Vec<i32> = (0..i32::try_from(fences.len()).unwrap()).collect();
        let raw: Vec<i64> = fences.iter().map(|f| f.get()).collect();
        let reset = async || {
            sqlx::query("DELETE FROM layout_probe")
                .execute(&db.pool)
                .await
                .unwrap();
            sqlx::query(
                "INSERT INTO layout_probe SELECT i, 0, f FROM unnest($1::int[], $2::bigint[]) AS u(i, f)",
            )
            .bind(&ids)
            .bind(&raw)
            .execute(&db.pool)
            .await
            .unwrap();
        };
        let stored = async || -> Vec<i64> {
            sqlx::query_scalar("SELECT fence FROM layout_probe ORDER BY id")
                .fetch_all(&db.pool)
                .await
                .unwrap()
        };
        let written = |f: &StoredFence| match lease.classify(f.get()) {
            Relation::Older => Some(lease.lease_fence()),
            Relation::Own => f.next().map(StoredFence::get),
            _ => None,
        };

        // Single-row updates.
        reset().await;
        for (id, f) in ids.iter().zip(&fences) {
            let result = repo.update(&db.pool, lease, &Probe { id: *id, v: 1 }).await;
            match (lease.classify(f.get()), result) {
                (Relation::Older | Relation::Own, Ok(())) => {}
                (
                    Relation::Newer { other_counter },
                    Err(Error::StaleToken {
                        current,
                        other_counter: o,
                        ..
                    }),
                ) => {
                    assert_eq!((current, o), (f.token(), other_counter), "{f:?} {lease:?}");
                }
                (Relation::Duplicate, Err(Error::DuplicateToken { .. }))
                | (Relation::Sealed, Err(Error::RowSealed { .. })) => {}
                (relation, result) => panic!("{f:?} for {lease:?}: {relation:?} but {result:?}"),
            }
        }
        let expected: Vec<i64> = fences
            .iter()
            .map(|f| written(f).unwrap_or(f.get()))
            .collect();
        assert_eq!(stored().await, expected, "single-row writes of {lease:?}");

        // One batch over the same fences.
        reset().await;
        let rows: Vec<Probe> = ids.iter().map(|id| Probe { id: *id, v: 2 }).collect();
        let outcome = repo.update_many(&db.pool, lease, &rows).await.unwrap();
        for (f, got) in fences.iter().zip(&outcome.rows) {
            let want = match lease.classify(f.get()) {
                Relation::Older | Relation::Own => RowOutcome::Applied,
                Relation::Newer { other_counter } => RowOutcome::Stale {
                    current: f.token(),
                    other_counter,
                },
                Relation::Duplicate => RowOutcome::DuplicateToken,
                Relation::Sealed => RowOutcome::Sealed,
            };
            assert_eq!(*got, want, "{f:?} for {lease:?}");
        }
        assert_eq!(stored().await, expected, "a batch of {lease:?}");
    }
}
