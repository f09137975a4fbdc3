//! The effect ledger (`Effects`): idempotency keys that are the same for every holder of a
//! work item, fenced like row writes, audited when refused; and the proof against a real HTTP
//! provider on loopback that honours `Idempotency-Key` — with the ledger one charge per
//! invoice, with a fresh key per call (the control) two.

use crate::support;

use std::time::Duration;

use pgfence::{
    Effects, Error, Fence, Fencing, Lease, RedisIssuer, Resource, effect::EffectOutcome,
    error::StaleTarget, issuer::PgIssuer,
};
use pgfence_testkit::Provider;
use pgfence_testkit::provider::charge;
use serde_json::json;
use support::{TestDb, assert_stale, issuer, unique_resource};

const SEC: Duration = Duration::from_secs(1);
const T: Duration = Duration::from_secs(5);

/// Two leases on one resource, `a` older than `b` (a released before b was taken).
async fn two_leases(issuer: &RedisIssuer, resource: &Resource) -> (Lease, Lease) {
    let a = issuer.acquire(resource, 10 * SEC).await.unwrap().unwrap();
    issuer.release(&a).await.unwrap();
    let b = issuer.acquire(resource, 10 * SEC).await.unwrap().unwrap();
    (a, b)
}

async fn audit_ops(db: &TestDb) -> Vec<(String, i64, i64)> {
    sqlx::query_as(
        "SELECT operation, presented, current FROM pgfence.audit WHERE table_name = '\"pgfence\".\"effect\"' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// The key is the same for every holder and never the token; a newer holder takes the effect
/// over; the zombie is refused before its call and cannot overwrite the outcome; a later
/// holder sees the call is done.
#[tokio::test]
async fn one_key_per_work_item_fenced_like_a_row_write() {
    let db = TestDb::new().await;
    let effects = Effects::new(db.pool.clone());
    let issuer = issuer().await;
    let resource = unique_resource("effects");
    let (a, b) = two_leases(&issuer, &resource).await;

    let ea = effects
        .begin(&db.pool, &a, "invoice:42", "charge")
        .await
        .unwrap();
    assert!(ea.recorded().is_none() && !ea.is_done());
    assert_eq!(ea.holders(), 1);
    let key = ea.idempotency_key().to_owned();
    assert_eq!(key.len(), 36, "a UUID: {key}");
    // The same lease again: the same key, no new holder.
    let again = effects
        .begin(&db.pool, &a, "invoice:42", "charge")
        .await
        .unwrap();
    assert_eq!(
        (again.idempotency_key(), again.holders()),
        (key.as_str(), 1)
    );
    // Another step or work item: another key.
    let other = effects
        .begin(&db.pool, &a, "invoice:42", "email")
        .await
        .unwrap();
    assert_ne!(other.idempotency_key(), key);
    let other = effects
        .begin(&db.pool, &a, "invoice:43", "charge")
        .await
        .unwrap();
    assert_ne!(other.idempotency_key(), key);

    // B takes over: the same key (A may have called already), two holders.
    let eb = effects
        .begin(&db.pool, &b, "invoice:42", "charge")
        .await
        .unwrap();
    assert_eq!((eb.idempotency_key(), eb.holders()), (key.as_str(), 2));
    assert!(eb.recorded().is_none());

    // Zombie A reaches its call point again: refused before calling, audited.
    let err = effects
        .begin(&db.pool, &a, "invoice:42", "charge")
        .await
        .unwrap_err();
    assert_stale(&err, a.token().get(), b.token().get());
    match &err {
        Error::StaleToken {
            target:
                StaleTarget::Row {
                    table,
                    key,
                    resource: r,
                    ..
                },
            ..
        } => {
            assert_eq!(table, "\"pgfence\".\"effect\"");
            assert_eq!(key, r#"["invoice:42","charge"]"#);
            assert_eq!(r.as_deref(), Some(resource.as_str()));
        }
        other => panic!("{other:?}"),
    }
    // B records its outcome; A cannot overwrite it.
    effects
        .finish(
            &db.pool,
            &b,
            &eb,
            EffectOutcome::Succeeded(json!({"id": "ch_1"})),
        )
        .await
        .unwrap();
    let err = effects
        .finish(
            &db.pool,
            &a,
            &ea,
            EffectOutcome::Failed(json!({"id": "zombie"})),
        )
        .await
        .unwrap_err();
    assert_stale(&err, a.token().get(), b.token().get());
    let record = effects
        .status(&db.pool, &resource, "invoice:42", "charge")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (
            record.state.as_str(),
            record.outcome,
            record.token,
            record.holders
        ),
        ("succeeded", Some(json!({"id": "ch_1"})), b.token().get(), 2)
    );
    assert_eq!(record.holder.as_deref(), Some(b.owner()));
    assert_eq!(
        audit_ops(&db).await,
        [
            ("effect".to_owned(), a.token().get(), b.token().get()),
            ("effect_finish".to_owned(), a.token().get(), b.token().get()),
        ]
    );

    // A later holder is told the call is done, with the same key.
    issuer.release(&b).await.unwrap();
    let c = issuer.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
    let ec = effects
        .begin(&db.pool, &c, "invoice:42", "charge")
        .await
        .unwrap();
    assert!(ec.is_done());
    assert_eq!(ec.idempotency_key(), key);
    assert_eq!(
        ec.recorded(),
        Some(&EffectOutcome::Succeeded(json!({"id": "ch_1"})))
    );
    assert_eq!(ec.holders(), 3);
}

/// A newer lease that checked the resource fences the zombie out of effects it never
/// recorded; a finish with no begin writes nothing; bad input changes nothing.
#[tokio::test]
async fn refusals_before_anything_is_written() {
    let db = TestDb::new().await;
    let effects = Effects::new(db.pool.clone());
    let issuer = issuer().await;
    let resource = unique_resource("effects-mark");
    let (a, b) = two_leases(&issuer, &resource).await;
    let mut tx = db.pool.begin().await.unwrap();
    Fence::new(db.pool.clone())
        .check(&mut *tx, &resource, &b)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let err = effects
        .begin(&db.pool, &a, "invoice:1", "charge")
        .await
        .unwrap_err();
    assert_stale(&err, a.token().get(), b.token().get());
    assert!(
        effects
            .status(&db.pool, &resource, "invoice:1", "charge")
            .await
            .unwrap()
            .is_none(),
        "nothing recorded"
    );
    let err = effects
        .finish_step(
            &db.pool,
            &b,
            "invoice:9",
            "charge",
            EffectOutcome::Succeeded(json!(1)),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::NotFound { ref table, .. } if table == "\"pgfence\".\"effect\""),
        "{err:?}"
    );
    for (work, step) in [("", "charge"), ("w", ""), ("w\0x", "s")] {
        assert!(matches!(
            effects.begin(&db.pool, &b, work, step).await,
            Err(Error::Invalid(pgfence::error::InvalidInput::Effect(_)))
        ));
    }
    let long = "k".repeat(201);
    assert!(matches!(
        effects.begin(&db.pool, &b, &long, "s").await,
        Err(Error::Invalid(pgfence::error::InvalidInput::Effect(_)))
    ));
    // A bare token has no resource to record the effect under.
    assert!(matches!(
        effects
            .begin(&db.pool, Fencing::new(b.token()), "w", "s")
            .await,
        Err(Error::Invalid(pgfence::error::InvalidInput::Effect(_)))
    ));
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM pgfence.effect")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(rows, 0);
}

#[derive(Clone, sqlx::FromRow)]
struct Invoice {
    id: i32,
    status: String,
}
pgfence::fenced_table!(Invoice { table: "fx_invoice", key: id: i32, columns: [status] });

/// In the caller's transaction, the outcome commits (or rolls back) with the job's own row
/// write; resources of one fencing domain share their effects.
#[tokio::test]
async fn in_the_callers_transaction_and_across_a_domain() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE fx_invoice (id int PRIMARY KEY, status text NOT NULL); \
         INSERT INTO fx_invoice VALUES (1, 'open');",
    )
    .await;
    pgfence::guard::guard(
        &db.pool,
        &pgfence::table::TableName::parse("fx_invoice").unwrap(),
    )
    .await
    .unwrap();
    let repo = pgfence::Repository::<Invoice>::new(db.pool.clone()).unwrap();
    let effects = Effects::new(db.pool.clone());
    let issuer = issuer().await;
    let domain = format!("fxd{}", rand::random::<u32>());
    let one = Resource::new(format!("{{{domain}}}batch:1")).unwrap();
    let two = Resource::new(format!("{{{domain}}}batch:2")).unwrap();
    let a = issuer.acquire(&one, 10 * SEC).await.unwrap().unwrap();
    let effect = effects
        .begin(&db.pool, &a, "invoice:1", "charge")
        .await
        .unwrap();

    // Rolled back with the row write: nothing recorded.
    let mut tx = db.pool.begin().await.unwrap();
    effects
        .finish(
            &mut *tx,
            &a,
            &effect,
            EffectOutcome::Succeeded(json!({"id": "ch_9"})),
        )
        .await
        .unwrap();
    repo.update(
        &mut *tx,
        &a,
        &Invoice {
            id: 1,
            status: "paid".into(),
        },
    )
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    let record = effects
        .status(&db.pool, &one, "invoice:1", "charge")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.state, "pending");
    // Committed with it.
    let mut tx = db.pool.begin().await.unwrap();
    effects
        .finish(
            &mut *tx,
            &a,
            &effect,
            EffectOutcome::Succeeded(json!({"id": "ch_9"})),
        )
        .await
        .unwrap();
    repo.update(
        &mut *tx,
        &a,
        &Invoice {
            id: 1,
            status: "paid".into(),
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();

    // Another resource of the domain meets the same effect (same scope: the domain).
    let b = issuer.acquire(&two, 10 * SEC).await.unwrap().unwrap();
    let seen = effects
        .begin(&db.pool, &b, "invoice:1", "charge")
        .await
        .unwrap();
    assert_eq!(seen.idempotency_key(), effect.idempotency_key());
    assert!(seen.is_done());
    assert_eq!(seen.resource(), &two);
}

/// The granted application role records and finishes effects and cannot touch the table.
#[tokio::test]
async fn the_application_role_uses_the_ledger_but_not_its_table() {
    let db = TestDb::new().await;
    let role = support::Role::create(&db, "pgfence_fx", "").await;
    pgfence::admin::grant(&db.pool, &role.ident())
        .await
        .unwrap();
    let app = role.pool(&db).await;
    // The PostgreSQL issuer, as the same role: no Redis at all.
    let issuer = PgIssuer::new(app.clone());
    let resource = unique_resource("fx-app");
    let lease = issuer.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
    let effects = Effects::new(app.clone());
    let effect = effects
        .begin(&app, &lease, "invoice:7", "charge")
        .await
        .unwrap();
    effects
        .finish(
            &app,
            &lease,
            &effect,
            EffectOutcome::Succeeded(json!({"id": "ch_7"})),
        )
        .await
        .unwrap();
    for sql in [
        "SELECT * FROM pgfence.effect",
        "UPDATE pgfence.effect SET state = 'pending'",
        "DELETE FROM pgfence.effect",
    ] {
        let err = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&app)
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("permission denied"),
            "{sql}: {err}"
        );
    }
    issuer.release(&lease).await.unwrap();
    app.close().await;
}

/// The incident, with a real HTTP provider: zombie A records the charge and pauses before
/// calling; B takes over and charges; A wakes and calls. With the ledger's key the provider
/// charges once (A's late call is a replay or a conflict); with a fresh key per call — the
/// classic mistake, here a key made from the token — it charges twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_zombie_does_not_charge_twice_with_the_ledgers_key() {
    let db = TestDb::new().await;
    let effects = Effects::new(db.pool.clone());
    let issuer = issuer().await;
    let provider = Provider::start(Duration::from_millis(50)).unwrap();
    for keyed in [true, false] {
        let resource = unique_resource("fx-zombie");
        let item = format!("invoice-{}", if keyed { "keyed" } else { "unkeyed" });
        let a = issuer
            .acquire(&resource, Duration::from_millis(200))
            .await
            .unwrap()
            .unwrap();
        let ea = effects.begin(&db.pool, &a, &item, "charge").await.unwrap();
        let key_for = |effect: &pgfence::effect::Effect, lease: &Lease| {
            if keyed {
                effect.idempotency_key().to_owned()
            } else {
                format!("{item}-{}", lease.token())
            }
        };
        let a_key = key_for(&ea, &a);
        // A pauses past its TTL; B takes the lock and the effect, and charges.
        let b = issuer
            .acquire_wait(&resource, 10 * SEC, 5 * SEC)
            .await
            .unwrap()
            .unwrap();
        let eb = effects.begin(&db.pool, &b, &item, "charge").await.unwrap();
        assert_eq!(
            eb.idempotency_key(),
            ea.idempotency_key(),
            "the ledger's key"
        );
        assert!(eb.recorded().is_none(), "A never recorded an outcome");
        let b_answer = charge(&provider.url(), Some(&key_for(&eb, &b)), &item, 100, T).unwrap();
        assert_eq!(b_answer.status, 200);
        // A wakes and makes the call it was about to make.
        let a_answer = charge(&provider.url(), Some(&a_key), &item, 100, T).unwrap();
        effects
            .finish(
                &db.pool,
                &b,
                &eb,
                EffectOutcome::Succeeded(json!(b_answer.body)),
            )
            .await
            .unwrap();
        let late = effects
            .finish(
                &db.pool,
                &a,
                &ea,
                EffectOutcome::Succeeded(json!(a_answer.body)),
            )
            .await
            .unwrap_err();
        assert!(late.is_stale(), "{late:?}");
        if keyed {
            assert!(
                a_answer.replayed,
                "the provider replays B's charge: {a_answer:?}"
            );
            assert_eq!(a_answer.body, b_answer.body);
            assert_eq!(provider.charges(&item), 1, "one charge");
        } else {
            assert!(!a_answer.replayed);
            assert_eq!(provider.charges(&item), 2, "the control charges twice");
        }
    }
    assert_eq!(
        provider.duplicates(),
        [("invoice-unkeyed".to_owned(), 2)],
        "only the control double-charged"
    );
}

/// Eight leases taking an effect over one after another, concurrently with the zombies they
/// fence out: one key throughout, and every zombie refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_takeovers_keep_one_key() {
    let db = TestDb::new().await;
    let effects = Effects::new(db.pool.clone());
    let issuer = issuer().await;
    let resource = unique_resource("fx-many");
    let mut leases = Vec::new();
    for _ in 0..8 {
        let l = issuer.acquire(&resource, 10 * SEC).await.unwrap().unwrap();
        issuer.release(&l).await.unwrap();
        leases.push(l);
    }
    let newest = leases.last().unwrap().clone();
    let mut tasks = Vec::new();
    for lease in leases {
        let (effects, pool) = (effects.clone(), db.pool.clone());
        tasks.push(tokio::spawn(async move {
            effects
                .begin(&pool, &lease, "invoice:8", "charge")
                .await
                .map(|e| e.idempotency_key().to_owned())
        }));
    }
    let mut keys = std::collections::BTreeSet::new();
    for t in tasks {
        if let Ok(key) = t.await.unwrap() {
            keys.insert(key);
        }
    }
    assert_eq!(keys.len(), 1, "{keys:?}");
    let record = effects
        .status(&db.pool, &resource, "invoice:8", "charge")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        record.token,
        newest.token().get(),
        "the newest lease holds it"
    );
    assert!(keys.contains(&record.idempotency_key));
}
