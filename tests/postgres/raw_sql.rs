//! Hand-written fenced SQL, as docs/sql.md ("Porting hand-written fenced SQL") shows it: the
//! write-up's statement as written, with the value the docs give (`Lease::fence()`,
//! `PGFENCE_FENCE`), for every write of a lease; the many-writes and audited forms; and what
//! the guard says when a token is used where a fence belongs.

use crate::support;

use pgfence::{Error, Fencing, Repository, Resource, table::TableName, token::StoredFence};
use sqlx::PgPool;
use support::{TestDb, audit_count, token};

/// The write-up's fenced write, exactly as the write-up prints it.
const WRITE_UP: &str = "UPDATE inventory_snapshot
SET    payload = $1, fence = $2
WHERE  sku = $3 AND fence < $2;";

/// The many-writes form, as docs/sql.md prints it.
const MANY_WRITES: &str = "UPDATE inventory_snapshot
   SET payload = $1, fence = pgfence.next_fence(fence, $2, $3, 'inventory_snapshot')
 WHERE sku = $4";

/// The audited form, as docs/sql.md prints it.
const AUDITED: &str = "UPDATE inventory_snapshot
   SET payload = $1, fence = pgfence.next_fence(fence, $2, $3, 'inventory_snapshot')
 WHERE sku = $4 AND pgfence.admits(fence, $2, $3, 'inventory_snapshot', $5)";

/// Its stop, as docs/sql.md prints it.
const STOP: &str = "SELECT pgfence.stop_unless(false, 'inventory_snapshot [\"A-1\"]')";

/// The statements these tests run are the ones docs/sql.md shows, to the character.
#[test]
fn the_porting_section_shows_the_statements_these_tests_run() {
    let doc = include_str!("../../docs/sql.md");
    let section = doc
        .split("## Porting hand-written fenced SQL")
        .nth(1)
        .expect("docs/sql.md has the porting section");
    for sql in [WRITE_UP, MANY_WRITES, AUDITED, STOP] {
        assert!(
            section.contains(&format!("```sql\n{sql}\n```")),
            "docs/sql.md does not show, as a block:\n{sql}"
        );
    }
    assert!(section.contains("+   .bind(lease.fence())"));
}

#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
struct Snapshot {
    sku: String,
    payload: String,
}

pgfence::fenced_table!(Snapshot { table: "inventory_snapshot", key: sku: String, columns: [payload] });

async fn setup() -> TestDb {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE inventory_snapshot (sku text PRIMARY KEY, payload text NOT NULL);
         INSERT INTO inventory_snapshot VALUES ('A-1', 'initial'), ('B-2', 'initial');",
    )
    .await;
    pgfence::guard::guard(&db.pool, &TableName::parse("inventory_snapshot").unwrap())
        .await
        .unwrap();
    db
}

fn lease(n: i64, holder: &str) -> Fencing {
    Fencing::new(token(n))
        .resource(Resource::new("inventory:A-1").unwrap())
        .holder(holder)
}

/// Runs the write-up's statement; the rows it updated, or the error.
async fn write_up(pool: &PgPool, payload: &str, fence: i64, sku: &str) -> Result<u64, Error> {
    sqlx::query(WRITE_UP)
        .bind(payload)
        .bind(fence)
        .bind(sku)
        .execute(pool)
        .await
        .map(|r| r.rows_affected())
        .map_err(Error::from)
}

async fn stored(db: &TestDb, sku: &str) -> (String, StoredFence) {
    let (payload, fence): (String, i64) =
        sqlx::query_as("SELECT payload, fence FROM inventory_snapshot WHERE sku = $1")
            .bind(sku)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    (payload, StoredFence::from_raw(fence))
}

/// The write-up's statement with `Lease::fence()`: every write of the live lease updates its
/// row, a newer lease takes over, the older one updates 0 rows; the repository and the raw
/// statement mix on one row.
#[tokio::test]
async fn the_write_ups_statement_works_as_written_for_every_write_of_a_lease() {
    let db = setup().await;
    let (one, two) = (lease(1, "worker-a"), lease(2, "worker-b"));

    // Lease 1 writes the row three times with the same value: 1 row each time.
    for n in 1..=3 {
        let rows = write_up(&db.pool, &format!("a{n}"), one.fence(), "A-1")
            .await
            .unwrap();
        assert_eq!(rows, 1, "lease 1's write {n}");
    }
    let (payload, fence) = stored(&db, "A-1").await;
    assert_eq!(payload, "a3");
    // What the guard stored is the lease's own fence, on its sequence cycle, not sealed.
    assert_eq!(fence.token(), 1);
    assert_eq!(
        fence.lease_fence().get(),
        one.fence() & !StoredFence::SEALED_SEQUENCE
    );
    assert!(!fence.is_sealed());

    // Lease 2 (newer) takes the row over; its next write applies too.
    assert_eq!(
        write_up(&db.pool, "b1", two.fence(), "A-1").await.unwrap(),
        1
    );
    assert_eq!(
        write_up(&db.pool, "b2", two.fence(), "A-1").await.unwrap(),
        1
    );
    // Lease 1 is a zombie now: 0 rows, the row keeps lease 2's data (the write-up's "0 rows
    // => our token is stale: abort").
    assert_eq!(
        write_up(&db.pool, "zombie", one.fence(), "A-1")
            .await
            .unwrap(),
        0
    );
    assert_eq!(stored(&db, "A-1").await.0, "b2");

    // The repository and the statement share the row: lease 2 writes through either.
    let repo = Repository::<Snapshot>::new(db.pool.clone()).unwrap();
    let snap = |p: &str| Snapshot {
        sku: "A-1".into(),
        payload: p.into(),
    };
    repo.update(&db.pool, &two, &snap("b3 (repository)"))
        .await
        .unwrap();
    assert_eq!(
        write_up(&db.pool, "b4", two.fence(), "A-1").await.unwrap(),
        1
    );
    let err = repo
        .update(&db.pool, &one, &snap("zombie"))
        .await
        .unwrap_err();
    support::assert_stale(&err, 1, 2);
    assert_eq!(stored(&db, "A-1").await.0, "b4");

    // A lease's value is the same from the lease and from its Fencing.
    assert_eq!(
        pgfence::token::StoredFence::from_raw(two.fence()).token(),
        2,
        "the fence carries the token"
    );
}

/// What PostgreSQL can see is refused with a message that says what to use instead: the
/// statement without `fence < $2` on a row a newer lease wrote (stale), a token where a fence
/// belongs on a row no lease wrote, and an UPDATE that leaves the fence as it was.
#[tokio::test]
async fn a_raw_write_that_is_wrong_in_a_way_postgres_sees_raises() {
    let db = setup().await;
    let (one, two) = (lease(1, "worker-a"), lease(2, "worker-b"));
    assert_eq!(
        write_up(&db.pool, "b", two.fence(), "A-1").await.unwrap(),
        1
    );

    // Without the `fence < $2` filter, a stale lease's write reaches the guard: PF001.
    let err = sqlx::query(
        "UPDATE inventory_snapshot SET payload = 'zombie', fence = $1 WHERE sku = 'A-1'",
    )
    .bind(one.fence())
    .execute(&db.pool)
    .await
    .map_err(Error::from)
    .unwrap_err();
    support::assert_stale(&err, 1, 2);
    assert_eq!(stored(&db, "A-1").await.0, "b");

    // The token where the fence belongs (the write-up read literally: `fence = $token`) on a
    // row no lease wrote: refused, naming PGFENCE_FENCE.
    let err = write_up(&db.pool, "token", 2, "B-2").await.unwrap_err();
    assert!(matches!(err, Error::LeaselessWrite { .. }), "{err:?}");
    let text = format!("{err}");
    assert!(
        text.contains("PGFENCE_FENCE") || text.contains("Lease::fence"),
        "{text}"
    );
    assert_eq!(stored(&db, "B-2").await.0, "initial");

    // An UPDATE that does not touch the fence: a lease-less write, not "presented token 2,
    // current token 2".
    let err = sqlx::query("UPDATE inventory_snapshot SET payload = 'admin' WHERE sku = 'A-1'")
        .execute(&db.pool)
        .await
        .map_err(Error::from)
        .unwrap_err();
    assert!(matches!(err, Error::LeaselessWrite { .. }), "{err:?}");
    assert!(!format!("{err}").contains("presented token"), "{err}");
    assert_eq!(stored(&db, "A-1").await.0, "b");
}

/// The control: the token in the write-up's statement (what the write-up's `$2` was before
/// this fix, and what `PGFENCE_TOKEN` holds) updates 0 rows for the newer, legitimate lease
/// once any lease wrote the row. That is why the docs give `Lease::fence()`.
#[tokio::test]
async fn control_the_token_in_the_write_up_statement_loses_the_live_holders_write() {
    let db = setup().await;
    let (one, two) = (lease(1, "worker-a"), lease(2, "worker-b"));
    assert_eq!(
        write_up(&db.pool, "a", one.fence(), "A-1").await.unwrap(),
        1
    );
    let rows = write_up(&db.pool, "b", two.token.get(), "A-1")
        .await
        .unwrap();
    assert_eq!(
        rows, 0,
        "a token compared with a stored fence filters the row out"
    );
    assert_eq!(stored(&db, "A-1").await.0, "a");
    // The same lease with its fence: applied.
    assert_eq!(
        write_up(&db.pool, "b", two.fence(), "A-1").await.unwrap(),
        1
    );
}

/// The many-writes form (`next_fence`) and the audited form (`admits` + `stop_unless`) of
/// docs/sql.md, as written there: the live lease writes twice, the zombie is refused, and the
/// audited form leaves one audit row for the zombie.
#[tokio::test]
async fn the_many_writes_and_audited_forms_work_as_documented() {
    let db = setup().await;
    let (one, two) = (lease(1, "worker-a"), lease(2, "worker-b"));
    let (many, audited) = (MANY_WRITES, AUDITED);
    // One connection, as psql has: stop_unless reads what admits noted in the session.
    let conn = std::sync::Arc::new(tokio::sync::Mutex::new(db.pool.acquire().await.unwrap()));
    let run = |sql: &'static str, f: &Fencing, payload: &'static str| {
        let q = sqlx::query(sql)
            .bind(payload)
            .bind(f.token.get())
            .bind(i32::from(f.tag()))
            .bind("A-1");
        let q = if sql.contains("admits") {
            q.bind("[\"A-1\"]")
        } else {
            q
        };
        let conn = conn.clone();
        async move {
            let mut conn = conn.lock().await;
            q.execute(&mut **conn)
                .await
                .map(|r| r.rows_affected())
                .map_err(Error::from)
        }
    };
    assert_eq!(run(many, &one, "a1").await.unwrap(), 1);
    assert_eq!(run(many, &one, "a2").await.unwrap(), 1);
    assert_eq!(run(audited, &two, "b1").await.unwrap(), 1);
    assert_eq!(run(audited, &two, "b2").await.unwrap(), 1);
    let err = run(many, &one, "zombie").await.unwrap_err();
    support::assert_stale(&err, 1, 2);
    let before = audit_count(&db.pool).await;
    assert_eq!(run(audited, &one, "zombie").await.unwrap(), 0);
    assert_eq!(
        audit_count(&db.pool).await,
        before + 1,
        "admits audits the zombie"
    );
    // stop_unless turns the audited 0 rows into an error naming the rejection.
    let err = sqlx::query(STOP)
        .execute(&mut **conn.lock().await)
        .await
        .map_err(Error::from)
        .unwrap_err();
    let Some(sqlx::Error::Database(db_err)) = (match &err {
        Error::Backend(b) => b.as_sqlx(),
        _ => None,
    }) else {
        panic!("{err:?}")
    };
    assert_eq!(db_err.code().as_deref(), Some("PF001"), "{err}");
    assert!(
        err.to_string()
            .contains("presented token 1, current token 2"),
        "{err}"
    );
    assert_eq!(stored(&db, "A-1").await.0, "b2");
}
