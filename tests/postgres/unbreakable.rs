//! Fences people cannot break by accident (issue 20): lease-less writers (`fence = fence +
//! 1`, copies, bypasses, observe mode) never silently lose a lease's or their own write; one
//! lease writes one row any number of times; a bypass lives only in its transaction; a 0.2
//! database upgrades in place.

use crate::support;

use pgfence::{Error, Fencing, Repository, Resource, table::TableName};
use sqlx::{AssertSqlSafe, Connection, PgConnection};
use support::{TestDb, assert_stale, audit_count, token};

#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
struct Account {
    id: i64,
    balance: i64,
}

pgfence::fenced_table!(Account { table: "accounts", key: id: i64, columns: [balance] });

fn acct(id: i64, balance: i64) -> Account {
    Account { id, balance }
}

fn accounts() -> TableName {
    TableName::parse("accounts").unwrap()
}

async fn setup() -> (TestDb, Repository<Account>) {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE accounts (id bigint PRIMARY KEY, balance bigint NOT NULL);
         INSERT INTO accounts VALUES (14, 0), (15, 0);",
    )
    .await;
    pgfence::guard::guard(&db.pool, &accounts()).await.unwrap();
    let repo = Repository::new(db.pool.clone()).unwrap();
    (db, repo)
}

fn lease(n: i64, holder: &str) -> Fencing {
    Fencing::new(token(n))
        .holder(holder)
        .resource(Resource::in_domain("billing", "account:14").unwrap())
}

async fn balance(db: &TestDb, id: i64) -> i64 {
    sqlx::query_scalar("SELECT balance FROM accounts WHERE id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

async fn fence(db: &TestDb, id: i64) -> i64 {
    sqlx::query_scalar("SELECT fence FROM accounts WHERE id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

async fn raw(db: &TestDb, sql: &str) -> Result<u64, sqlx::Error> {
    sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
        .execute(&db.pool)
        .await
        .map(|r| r.rows_affected())
}

/// The server's DETAIL (`detail`) or HINT (`hint`) of a database error.
fn pg_field(err: &sqlx::Error, field: &str) -> String {
    err.as_database_error()
        .and_then(|e| e.try_downcast_ref::<sqlx::postgres::PgDatabaseError>())
        .and_then(|e| match field {
            "detail" => e.detail(),
            _ => e.hint(),
        })
        .unwrap_or_default()
        .to_owned()
}

#[track_caller]
fn sqlstate(err: &sqlx::Error) -> String {
    err.as_database_error()
        .and_then(|e| e.code())
        .map(|c| c.into_owned())
        .unwrap_or_default()
}

/// The 0.2 billing incident, replayed on a table with 0.2's guard (`WHEN (NEW.fence <=
/// OLD.fence)`) and 0.2's write rule (`GREATEST(fence + 1, L)`): a lease-less refund with
/// `fence = fence + 1` passes, and the lease's next write — computed from its earlier read —
/// silently overwrites it. The control must lose, or the test below proves nothing.
#[tokio::test]
async fn control_with_0_2_rules_the_refund_vanishes() {
    let (db, _) = setup().await;
    db.exec(
        "CREATE TABLE accounts_v02 (id bigint PRIMARY KEY, balance bigint NOT NULL,
                                    fence bigint NOT NULL DEFAULT 0);
         INSERT INTO accounts_v02 VALUES (14, 0);
         CREATE TRIGGER guard_v02 BEFORE UPDATE ON accounts_v02 FOR EACH ROW
           WHEN (NEW.fence <= OLD.fence) EXECUTE FUNCTION pgfence.reject_stale_update();",
    )
    .await;
    let l = lease(5, "billing-run").lease_fence();
    let write = |b: i64| {
        format!(
            "UPDATE accounts_v02 SET balance = {b}, fence = GREATEST(fence + 1, {l}) WHERE id = 14"
        )
    };
    raw(&db, &write(100)).await.unwrap(); // the lease read 0, wrote 100
    raw(
        &db,
        "UPDATE accounts_v02 SET balance = balance + 50, fence = fence + 1 WHERE id = 14",
    )
    .await
    .expect("0.2's guard lets fence + 1 through");
    raw(&db, &write(130)).await.unwrap(); // the lease, from its read of 100: +30
    let b: i64 = sqlx::query_scalar("SELECT balance FROM accounts_v02 WHERE id = 14")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(b, 130, "the refund of 50 vanished under 0.2's rules");
}

#[tokio::test]
async fn fence_plus_n_is_refused_and_says_what_to_do() {
    let (db, repo) = setup().await;
    let job = lease(5, "billing-run");
    repo.update(&db.pool, &job, &acct(14, 100)).await.unwrap();
    let before = fence(&db, 14).await;
    for sql in [
        "UPDATE accounts SET balance = balance + 50, fence = fence + 1 WHERE id = 14",
        "UPDATE accounts SET balance = balance + 50, fence = fence + 100 WHERE id = 14",
        "UPDATE accounts SET balance = balance + 50, fence = fence + 4096 WHERE id = 14",
        // A copy of another row's fence that is no lease's write here (row 15 was never
        // written: fence 0).
        "UPDATE accounts SET balance = balance + 50, fence = (SELECT fence FROM accounts WHERE id = 15) WHERE id = 14",
    ] {
        let err = raw(&db, sql).await.unwrap_err();
        let code = sqlstate(&err);
        assert!(code == "PF007" || code == "PF001", "{sql}: {err}");
        let text = err.to_string();
        assert!(
            text.contains("pgfence run")
                || text.contains("recorded only in the PostgreSQL server log"),
            "{sql}: {text}"
        );
        let hint = pg_field(&err, "hint");
        assert!(
            hint.contains("pgfence run") && hint.contains("pgfence.bypass"),
            "{sql}: hint {hint}"
        );
        if code == "PF007" {
            match Error::from(err) {
                Error::LeaselessWrite { table, old, .. } => {
                    assert_eq!(table, "\"public\".\"accounts\"");
                    assert_eq!(old, before);
                }
                e => panic!("{sql}: {e:?}"),
            }
        }
    }
    assert_eq!(balance(&db, 14).await, 100, "no refund applied");
    assert_eq!(fence(&db, 14).await, before);
    // The lease goes on; nothing of anyone's was lost silently (the refund was refused out
    // loud, to the one who tried it).
    repo.update(&db.pool, &job, &acct(14, 130)).await.unwrap();
    assert_eq!(balance(&db, 14).await, 130);
}

#[tokio::test]
async fn a_copied_fence_of_a_newer_lease_fences_out_every_earlier_lease() {
    let (db, repo) = setup().await;
    let old = lease(5, "old");
    let newer = lease(7, "newer");
    repo.update(&db.pool, &old, &acct(14, 1)).await.unwrap();
    repo.update(&db.pool, &newer, &acct(15, 2)).await.unwrap();
    // Row 15 holds lease 7's first-write fence: copied onto row 14 it is a newer lease's write.
    raw(
        &db,
        "UPDATE accounts SET balance = 99, fence = (SELECT fence FROM accounts WHERE id = 15) WHERE id = 14",
    )
    .await
    .unwrap();
    let audited = audit_count(&db.pool).await;
    let err = repo.update(&db.pool, &old, &acct(14, 3)).await.unwrap_err();
    assert_stale(&err, 5, 7);
    assert_eq!(audit_count(&db.pool).await, audited + 1, "audited");
    assert_eq!(balance(&db, 14).await, 99, "the copy's change stands");
}

#[tokio::test]
async fn observe_mode_seals_a_lease_less_write_against_the_lease() {
    let (db, repo) = setup().await;
    pgfence::guard::guard_with(&db.pool, &accounts(), pgfence::guard::GuardMode::Observe)
        .await
        .unwrap();
    let job = lease(5, "billing-run");
    repo.update(&db.pool, &job, &acct(14, 100)).await.unwrap();
    raw(
        &db,
        "UPDATE accounts SET balance = balance + 50, fence = fence + 1 WHERE id = 14",
    )
    .await
    .expect("observe mode lets it through");
    assert_eq!(balance(&db, 14).await, 150);
    let audited = audit_count(&db.pool).await;
    let err = repo
        .update(&db.pool, &job, &acct(14, 130))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::RowSealed { token: 5, .. }), "{err:?}");
    assert_eq!(audit_count(&db.pool).await, audited + 1);
    assert_eq!(balance(&db, 14).await, 150, "the refund stands");
    // A new lease re-reads and writes.
    repo.update(&db.pool, &lease(6, "next"), &acct(14, 180))
        .await
        .unwrap();
}

#[tokio::test]
async fn one_lease_writes_one_row_a_million_times() {
    let (db, repo) = setup().await;
    let job = lease(5, "leader");
    let tag = i32::from(job.tag());
    repo.update(&db.pool, &job, &acct(14, 0)).await.unwrap();
    // A million writes through the guard trigger, server-side (one round trip; a commit
    // every thousand, as a long-running job's transactions would, so old row versions are
    // pruned).
    raw(
        &db,
        &format!(
            "DO $$ BEGIN FOR i IN 1..1000000 LOOP
               UPDATE accounts SET balance = balance + 1,
                      fence = pgfence.next_fence(fence, 5, {tag}, 'accounts') WHERE id = 14;
               IF i % 1000 = 0 THEN COMMIT; END IF;
             END LOOP; END $$"
        ),
    )
    .await
    .unwrap();
    assert_eq!(balance(&db, 14).await, 1_000_000);
    // And through the repository, across the sequence cycle (4,095 values) three times.
    for i in 1..=12_500_i64 {
        repo.update(&db.pool, &job, &acct(14, 1_000_000 + i))
            .await
            .unwrap_or_else(|e| panic!("write {i}: {e}"));
    }
    assert_eq!(balance(&db, 14).await, 1_012_500);
    // Older leases stay fenced out; the same token from another holder is a duplicate.
    let err = repo
        .update(&db.pool, &lease(4, "zombie"), &acct(14, 0))
        .await
        .unwrap_err();
    assert_stale(&err, 4, 5);
    let err = repo
        .update(&db.pool, &lease(5, "twin"), &acct(14, 0))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::DuplicateToken { token: 5, .. }),
        "{err:?}"
    );
    assert_eq!(balance(&db, 14).await, 1_012_500);
}

/// A leader-style lease (one holder for hours, renewing its TTL) that writes a state row once
/// a second: four hours of writes, with the lease extended on the real issuer as it goes.
#[tokio::test]
async fn a_leader_lease_renewed_for_hours_keeps_writing_its_state_row() {
    let (db, repo) = setup().await;
    let issuer = support::issuer().await;
    let resource = support::unique_resource("leader");
    let mut lease = issuer
        .acquire(&resource, std::time::Duration::from_secs(30))
        .await
        .unwrap()
        .expect("free");
    let fencing = Fencing::from(&lease);
    for second in 1..=14_400_i64 {
        if second % 1_000 == 0 {
            let state = issuer
                .extend(&mut lease, std::time::Duration::from_secs(30))
                .await
                .unwrap();
            assert_eq!(state, pgfence::issuer::LeaseState::Held);
        }
        repo.update(&db.pool, &fencing, &acct(14, second))
            .await
            .unwrap_or_else(|e| panic!("second {second}: {e}"));
    }
    assert_eq!(balance(&db, 14).await, 14_400);
    issuer.release(&lease).await.unwrap();
    let next = issuer
        .acquire(&resource, std::time::Duration::from_secs(30))
        .await
        .unwrap()
        .expect("free");
    repo.update(&db.pool, &next, &acct(14, 0)).await.unwrap();
    let err = repo
        .update(&db.pool, &fencing, &acct(14, 1))
        .await
        .unwrap_err();
    assert!(err.is_stale(), "{err:?}");
}

/// A bypass set with plain `SET` (session level) or `SET LOCAL` bypasses nothing; one started
/// with `pgfence.bypass()` ends with its transaction, also on a pooled connection.
#[tokio::test]
async fn a_bypass_lives_only_in_its_transaction() {
    let (db, repo) = setup().await;
    repo.update(&db.pool, &lease(5, "job"), &acct(14, 1))
        .await
        .unwrap();
    let admin = support::Role::create(&db, "pgfence_admin", "").await;
    db.exec(&format!(
        "GRANT SELECT, UPDATE ON accounts TO {}",
        admin.quoted()
    ))
    .await;
    assert!(
        pgfence::guard::allow_bypass(&db.pool, &admin.name)
            .await
            .unwrap()
    );
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(db.options.clone().username(&admin.name))
        .await
        .unwrap();

    // Session level: left on the pooled connection for whoever gets it next.
    sqlx::query("SET pgfence.bypass = 'left behind'")
        .execute(&pool)
        .await
        .unwrap();
    let err = sqlx::query("UPDATE accounts SET balance = 2 WHERE id = 14")
        .execute(&pool)
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&err), "PF006", "{err}");
    match Error::from(err) {
        Error::BypassRefused {
            role, reason, why, ..
        } => {
            assert_eq!(role, admin.name);
            assert_eq!(reason, "left behind");
            assert!(why.contains("plain SET"), "{why}");
        }
        e => panic!("{e:?}"),
    }
    // SET LOCAL, the 0.2 spelling, is not enough either.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL pgfence.bypass = 'old spelling'")
        .execute(&mut *tx)
        .await
        .unwrap();
    let err = sqlx::query("UPDATE accounts SET balance = 2 WHERE id = 14")
        .execute(&mut *tx)
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&err), "PF006", "{err}");
    drop(tx);
    sqlx::query("RESET pgfence.bypass")
        .execute(&pool)
        .await
        .unwrap();

    let mut tx = pool.begin().await.unwrap();
    pgfence::guard::bypass(&mut tx, "refund #123")
        .await
        .unwrap();
    sqlx::query("UPDATE accounts SET balance = balance + 50 WHERE id = 14")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(balance(&db, 14).await, 51);
    // The next transaction on the same pooled connection is not bypassed.
    let err = sqlx::query("UPDATE accounts SET balance = 0 WHERE id = 14")
        .execute(&pool)
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&err), "PF007", "{err}");
    assert_eq!(balance(&db, 14).await, 51);
    let bypasses: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pgfence.audit WHERE operation = 'bypass'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(bypasses, 1);
    pool.close().await;
    // The bypass sealed the row against lease 5.
    let err = repo
        .update(&db.pool, &lease(5, "job"), &acct(14, 9))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::RowSealed { .. }), "{err:?}");
}

/// Audit rows say what happened, one way: a rejected claim is operation `claim`, and the
/// guard trigger and the repository spell a table the same way.
#[tokio::test]
async fn audit_rows_name_the_operation_and_the_table_one_way() {
    let (db, repo) = setup().await;
    repo.update(&db.pool, &lease(7, "newer"), &acct(14, 1))
        .await
        .unwrap();
    let err = repo
        .claim::<_, Account>(&db.pool, &lease(5, "zombie"), &14)
        .await
        .unwrap_err();
    assert_stale(&err, 5, 7);
    pgfence::guard::guard_with(&db.pool, &accounts(), pgfence::guard::GuardMode::Observe)
        .await
        .unwrap();
    raw(&db, "UPDATE accounts SET balance = 5 WHERE id = 15")
        .await
        .unwrap();
    let rows: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT operation, table_name FROM pgfence.audit ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        rows,
        [
            (
                "claim".to_owned(),
                Some("\"public\".\"accounts\"".to_owned())
            ),
            (
                "observe".to_owned(),
                Some("\"public\".\"accounts\"".to_owned())
            ),
        ]
    );
}

/// docs/sql.md documents the DETAIL of a rejection with the keys the product writes.
#[tokio::test]
async fn the_readme_documents_the_detail_keys_the_product_writes() {
    let (db, _) = setup().await;
    let readme = include_str!("../../docs/sql.md");
    let err = raw(
        &db,
        "UPDATE accounts SET fence = pgfence.next_fence(fence, 1, 0, 'accounts') WHERE id = 14; \
         UPDATE accounts SET fence = pgfence.next_fence(fence, 9, 0, 'accounts') WHERE id = 14; \
         UPDATE accounts SET fence = pgfence.next_fence(fence, 1, 0, 'accounts') WHERE id = 14",
    )
    .await
    .unwrap_err();
    assert_eq!(
        pg_field(&err, "detail"),
        "presented=1 current=9 table=accounts"
    );
    let check = raw(
        &db,
        "SELECT pgfence.check('r', 9, 0); SELECT pgfence.check('r', 2, 0)",
    )
    .await
    .unwrap_err();
    assert_eq!(
        pg_field(&check, "detail"),
        "presented=2 current=9 resource=r"
    );
    for documented in [
        "`DETAIL: presented=<n> current=<n> table=<table>`",
        "`DETAIL: presented=<n> current=<n> resource=<resource>`",
    ] {
        assert!(
            readme.contains(documented),
            "docs/sql.md lacks {documented}"
        );
    }
    assert!(
        !readme.contains("target=<name>"),
        "docs/sql.md documents a key nothing writes"
    );
}

/// A database that 0.2.0 (migrations V1..V6) guarded and wrote upgrades in place: fences keep
/// their meaning, the guard triggers get the new rule, audit table names one spelling.
#[tokio::test]
async fn a_0_2_database_upgrades_in_place() {
    let db = TestDb::empty().await;
    let mut conn = PgConnection::connect_with(&db.options).await.unwrap();
    crate::squash::apply_0_2_0(&mut conn).await;
    db.exec(
        "CREATE TABLE accounts (id bigint PRIMARY KEY, balance bigint NOT NULL);
         INSERT INTO accounts VALUES (14, 0), (15, 0), (16, 0);
         SELECT pgfence.guard('public', 'accounts');",
    )
    .await;
    let job = lease(5, "billing-run");
    let tag = i32::from(job.tag());
    // 0.2's writes: lease 5 wrote row 14 eighteen times (fence L + 17), row 15 4,096 times
    // (L + 4095, the 0.2 cap), and an observed write left a `public.accounts` audit row.
    for _ in 0..18 {
        raw(
            &db,
            &format!(
                "UPDATE accounts SET fence = pgfence.next_fence(fence, 5, {tag}) WHERE id = 14"
            ),
        )
        .await
        .unwrap();
    }
    raw(
        &db,
        &format!("UPDATE accounts SET fence = pgfence.lease_fence(5, {tag}) + 4095 WHERE id = 15"),
    )
    .await
    .unwrap();
    db.exec(
        "SELECT pgfence.guard('public', 'accounts', 'observe');
         UPDATE accounts SET balance = 1 WHERE id = 16;
         SELECT pgfence.guard('public', 'accounts', 'enforce');",
    )
    .await;
    assert_eq!(fence(&db, 14).await, job.lease_fence() + 17);
    // 0.2's guard let fence + 1 through.
    raw(
        &db,
        "BEGIN; UPDATE accounts SET fence = fence + 1 WHERE id = 14; ROLLBACK",
    )
    .await
    .expect("0.2 rule");

    let applied = pgfence::admin::migrate(&mut conn).await.unwrap();
    assert_eq!(
        applied.iter().map(|m| m.version).collect::<Vec<_>>(),
        [7],
        "only the 0.3 migration is new"
    );
    conn.close().await.unwrap();
    let repo = Repository::<Account>::new(db.pool.clone()).unwrap();
    // The same lease goes on writing row 14 where 0.2 left it.
    repo.update(&db.pool, &job, &acct(14, 7)).await.unwrap();
    assert_eq!(balance(&db, 14).await, 7);
    // Row 15 reads as sealed for lease 5; lease 6 writes it.
    let err = repo.update(&db.pool, &job, &acct(15, 7)).await.unwrap_err();
    assert!(matches!(err, Error::RowSealed { token: 5, .. }), "{err:?}");
    repo.update(&db.pool, &lease(6, "next"), &acct(15, 8))
        .await
        .unwrap();
    // Older leases stay out.
    let err = repo
        .update(&db.pool, &lease(4, "zombie"), &acct(14, 0))
        .await
        .unwrap_err();
    assert_stale(&err, 4, 5);
    // The trigger on the already guarded table has the new rule.
    let err = raw(&db, "UPDATE accounts SET fence = fence + 1 WHERE id = 14")
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&err), "PF007", "{err}");
    let names: Vec<Option<String>> =
        sqlx::query_scalar("SELECT DISTINCT table_name FROM pgfence.audit")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert!(
        names
            .iter()
            .all(|n| n.as_deref() == Some("\"public\".\"accounts\"")),
        "{names:?}"
    );
}

/// One bad client cannot lock a resource or a row out: a token absurdly far above the current
/// one is refused and audited; the owner can move the bound.
#[tokio::test]
async fn a_token_absurdly_far_ahead_is_refused_and_audited() {
    let (db, repo) = setup().await;
    let max = pgfence::token::MAX_TOKEN;
    repo.update(&db.pool, &lease(5, "job"), &acct(14, 1))
        .await
        .unwrap();
    // Through the repository (a forged Fencing).
    let before = audit_count(&db.pool).await;
    let err = repo
        .update(&db.pool, &lease(max, "forged"), &acct(14, 0))
        .await
        .unwrap_err();
    match &err {
        Error::TokenJump {
            presented,
            current,
            max_jump,
            ..
        } => {
            assert_eq!((*presented, *current), (max, 5));
            assert_eq!(*max_jump, 1 << 36);
        }
        e => panic!("{e:?}"),
    }
    assert_eq!(audit_count(&db.pool).await, before + 1, "audited");
    // Raw SQL with the fence of such a lease.
    let err = raw(
        &db,
        &format!("UPDATE accounts SET fence = pgfence.lease_fence({max}, 0) WHERE id = 14"),
    )
    .await
    .unwrap_err();
    assert_eq!(sqlstate(&err), "PF008", "{err}");
    // A resource check from SQL, non-raising: refused and audited.
    raw(&db, "SELECT pgfence.check('billing:run', 3, 0)")
        .await
        .unwrap();
    let held: bool = sqlx::query_scalar("SELECT pgfence.try_check('billing:run', $1, 0)")
        .bind(max)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(!held);
    assert_eq!(audit_count(&db.pool).await, before + 2);
    // The real leases go on.
    repo.update(&db.pool, &lease(6, "next"), &acct(14, 2))
        .await
        .unwrap();
    raw(&db, "SELECT pgfence.check('billing:run', 4, 0)")
        .await
        .unwrap();
    // The owner moves the bound; a jump within it passes.
    let old: i64 = sqlx::query_scalar("SELECT pgfence.set_max_token_jump(100)")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(old, 1 << 36);
    let err = repo
        .update(&db.pool, &lease(107, "far"), &acct(14, 3))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::TokenJump { max_jump: 100, .. }),
        "{err:?}"
    );
    repo.update(&db.pool, &lease(106, "near"), &acct(14, 3))
        .await
        .unwrap();
    // A fresh row has no reference: its first token is not bounded.
    repo.update(&db.pool, &lease(5_000, "fresh"), &acct(15, 1))
        .await
        .unwrap();
    // What is poisoned already (by hand as the owner, or before 0.3) doctor still finds.
    db.exec(&format!(
        "UPDATE pgfence.resource_fence SET fence = pgfence.lease_fence({max}, 0)
          WHERE resource = 'billing:run'"
    ))
    .await;
    let findings =
        pgfence::admin::doctor(&db.pool, None, &pgfence::admin::DoctorOptions::default())
            .await
            .unwrap();
    assert!(
        findings
            .iter()
            .any(|f| f.kind == pgfence::admin::FindingKind::FenceNearLimit
                && f.object.contains("billing:run")),
        "{findings:?}"
    );
    // The 0.3 migration applies again over itself (a repaired history) and keeps the owner's
    // bound.
    db.exec("DELETE FROM pgfence.refinery_schema_history WHERE version >= 7")
        .await;
    let applied = pgfence::admin::migrate(&db.pool).await.unwrap();
    assert_eq!(applied.len(), 1);
    let bound: i64 = sqlx::query_scalar("SELECT pgfence.max_token_jump()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(bound, 100);
}

/// A row taken over by another resource of the same fencing domain: the rejection says which
/// resource and token took it.
#[tokio::test]
async fn a_row_taken_over_by_another_resource_of_the_domain_says_which() {
    let (db, repo) = setup().await;
    let fence = pgfence::Fence::new(db.pool.clone());
    let domain = format!("billing{}", rand::random::<u32>());
    let account = Resource::in_domain(&domain, "account:14").unwrap();
    let nightly = Resource::in_domain(&domain, "run:nightly").unwrap();
    // The account job (token 1) wrote the row; the nightly run (token 2, same counter)
    // checked its resource and took the row over.
    let old = Fencing::new(token(1))
        .holder("account-job")
        .resource(account.clone());
    let run = Fencing::new(token(2))
        .holder("nightly")
        .resource(nightly.clone());
    repo.update(&db.pool, &old, &acct(14, 1)).await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    fence.check(&mut *tx, &nightly, &run).await.unwrap();
    repo.update(&mut *tx, &run, &acct(14, 2)).await.unwrap();
    tx.commit().await.unwrap();
    let err = repo.update(&db.pool, &old, &acct(14, 3)).await.unwrap_err();
    match &err {
        Error::StaleToken {
            target: pgfence::error::StaleTarget::Row { held_by, .. },
            presented: 1,
            current: 2,
            other_counter: false,
        } => assert_eq!(held_by.as_deref(), Some(nightly.as_str())),
        e => panic!("{e:?}"),
    }
    let text = err.to_string();
    assert!(
        text.contains(&format!("taken over by resource {nightly}")) && text.contains("current 2"),
        "{text}"
    );
    // A newer lease of the account's own resource is not "another resource".
    let newer = Fencing::new(token(3))
        .holder("account-job-2")
        .resource(account.clone());
    let mut tx = db.pool.begin().await.unwrap();
    fence.check(&mut *tx, &account, &newer).await.unwrap();
    repo.update(&mut *tx, &newer, &acct(14, 4)).await.unwrap();
    tx.commit().await.unwrap();
    let err = repo.update(&db.pool, &run, &acct(14, 5)).await.unwrap_err();
    assert!(
        err.to_string()
            .contains(&format!("taken over by resource {account}")),
        "{err}"
    );
    let err = repo.update(&db.pool, &old, &acct(14, 5)).await.unwrap_err();
    assert!(
        !err.to_string().contains("taken over"),
        "its own resource: {err}"
    );
}
