//! Migrations: idempotent, safe concurrently, and harmless to an existing database.

use crate::support;

use pgfence::{
    FenceToken,
    token::{MAX_TOKEN, Relation, StoredFence},
};
use support::TestDb;

#[tokio::test]
async fn second_run_is_a_no_op() {
    let db = TestDb::empty().await;
    let first = pgfence::admin::migrate(&db.pool).await.unwrap();
    assert_eq!(
        first.iter().map(|m| m.version).collect::<Vec<_>>(),
        (1..=7).collect::<Vec<_>>()
    );
    assert!(pgfence::admin::migrate(&db.pool).await.unwrap().is_empty());
    let status = pgfence::admin::migration_status(&db.pool).await.unwrap();
    assert!(status.iter().all(|m| m.applied_on.is_some()));
}

#[tokio::test]
async fn status_before_migrating_lists_pending() {
    let db = TestDb::empty().await;
    let status = pgfence::admin::migration_status(&db.pool).await.unwrap();
    assert!(!status.is_empty() && status.iter().all(|m| m.applied_on.is_none()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_runs_all_succeed_and_one_applies() {
    let db = TestDb::empty().await;
    let runs: Vec<_> = (0..4)
        .map(|_| {
            let pool = db.pool.clone();
            tokio::spawn(async move { pgfence::admin::migrate(&pool).await })
        })
        .collect();
    let mut applied = 0;
    for run in runs {
        applied += run
            .await
            .unwrap()
            .expect("every concurrent run succeeds")
            .len();
    }
    assert_eq!(applied, 7, "exactly one run applies V1 to V7");
}

/// A user's populated database with its own refinery history: only pgfence's schema appears.
#[tokio::test]
async fn existing_database_is_untouched() {
    let db = TestDb::empty().await;
    db.exec(
        "CREATE TABLE refinery_schema_history (version int4 PRIMARY KEY, name varchar(255), applied_on varchar(255), checksum varchar(255));
         INSERT INTO refinery_schema_history VALUES (1, 'users', '2024-01-01T00:00:00Z', '123'), (2, 'orders', '2024-01-02T00:00:00Z', '456');
         CREATE TABLE orders (id bigserial PRIMARY KEY, total bigint NOT NULL);
         INSERT INTO orders (total) SELECT g FROM generate_series(1, 1000) g;",
    )
    .await;
    let snapshot = || async {
        let history: Vec<(i32, String)> =
            sqlx::query_as("SELECT version, name FROM refinery_schema_history ORDER BY 1")
                .fetch_all(&db.pool)
                .await
                .unwrap();
        let orders: (i64, i64) = sqlx::query_as("SELECT count(*), sum(total)::bigint FROM orders")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        let columns: Vec<String> = sqlx::query_scalar(
            "SELECT table_name || '.' || column_name FROM information_schema.columns WHERE table_schema = 'public' ORDER BY 1",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        (history, orders, columns)
    };
    let before = snapshot().await;
    pgfence::admin::migrate(&db.pool).await.unwrap();
    assert_eq!(snapshot().await, before);
    let ours: i64 = sqlx::query_scalar("SELECT count(*) FROM pgfence.refinery_schema_history")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(ours, 7);

    // Guarding adds only the column and the trigger.
    pgfence::guard::guard(
        &db.pool,
        &pgfence::table::TableName::parse("orders").unwrap(),
    )
    .await
    .unwrap();
    let (history, orders, columns) = snapshot().await;
    assert_eq!((history, orders), (before.0, before.1));
    assert_eq!(columns.len(), before.2.len() + 1);
    assert!(columns.contains(&"orders.fence".to_owned()));
}

/// Inside the caller's transaction, migrate pins its own search path only while it runs: the
/// caller's (transaction-local) setting is what the transaction has afterwards, whether the
/// schema was migrated by this call or already current.
#[tokio::test]
async fn migrate_in_a_transaction_gives_the_search_path_back() {
    let db = TestDb::empty().await;
    for round in 0..2 {
        let mut tx = db.pool.begin().await.unwrap();
        sqlx::raw_sql("SET LOCAL search_path = public, pg_catalog")
            .execute(&mut *tx)
            .await
            .unwrap();
        let applied = pgfence::admin::migrate(&mut *tx).await.unwrap();
        assert_eq!(applied.is_empty(), round == 1, "round {round}");
        let path: String = sqlx::query_scalar("SELECT current_setting('search_path')")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert_eq!(path, "public, pg_catalog", "round {round}");
        tx.commit().await.unwrap();
    }
}

/// After migrating, only the layout's helpers spell its numbers: no other function of schema
/// pgfence holds the largest token, a shift by the token's position, the low mask, the
/// counter mask or the sequence step (the helpers are section 1 of the 0.3 migration; the
/// PostgreSQL issuer's token limit, among others, is read from them).
#[tokio::test]
async fn only_the_layout_helpers_spell_the_layout() {
    let db = TestDb::new().await;
    let shift = StoredFence::TOKEN_SHIFT;
    let literals = [
        MAX_TOKEN.to_string(),
        StoredFence::LOW_MASK.to_string(),
        (0xF_i64 << 20).to_string(),
        StoredFence::SEQUENCE_STEP.to_string(),
        // `>> 24` and `OPERATOR(pg_catalog.>>) 24`.
        format!(">>\\)? *{shift}\\M"),
        format!("<<\\)? *{shift}\\M"),
    ];
    let pattern = format!("({})", literals.join("|"));
    let spelled: Vec<String> = sqlx::query_scalar(
        "SELECT p.proname::text FROM pg_proc p
          WHERE p.pronamespace = 'pgfence'::regnamespace AND p.prosrc ~ $1
            AND p.proname NOT IN ('token_shift', 'tag_shift', 'max_tag', 'sealed_sequence',
                                  'sequence_step', 'max_token')
          ORDER BY 1",
    )
    .bind(&pattern)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(spelled, Vec::<String>::new(), "pattern {pattern}");
    // The pattern finds what it looks for: the helper that defines the step holds it.
    let step: bool = sqlx::query_scalar(
        "SELECT prosrc ~ $1 FROM pg_proc
          WHERE proname = 'sequence_step' AND pronamespace = 'pgfence'::regnamespace",
    )
    .bind(&pattern)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(step);
}

/// Fences that cover the layout's corners: no lease, pre-0.2 plain tokens, the first and the
/// largest token, every counter and holder bit, the sequence cycle's ends and the seal.
fn corner_fences() -> Vec<StoredFence> {
    let mut fences = vec![
        StoredFence::from_raw(0),
        StoredFence::from_raw(42),
        StoredFence::from_raw(StoredFence::LOW_MASK),
        StoredFence::from_raw(i64::MAX),
    ];
    for token in [1, 2, 4095, 1 << 24, MAX_TOKEN - 1, MAX_TOKEN] {
        for tag in [0_u16, 1, 0x80, 0xFF, 0x100, 0x800, 0xF00, 0xFFF] {
            let lease = StoredFence::lease(FenceToken::new(token).unwrap(), tag);
            fences.push(lease);
            fences.push(lease.next().unwrap());
            fences.push(StoredFence::from_raw(lease.get() + 4094));
            fences.push(lease.sealed());
        }
    }
    fences
}

/// The SQL layout helpers (migration V7) and StoredFence are one layout: the same parts, the same next step,
/// the same lease fence, for every corner fence; and next_fence (PL/pgSQL, on the helpers)
/// decides like Fencing::classify.
#[tokio::test]
async fn the_sql_layout_helpers_are_stored_fence() {
    let db = TestDb::new().await;
    let constants: (i32, i32, i32, i64, i64, i64, i64) = sqlx::query_as(
        "SELECT pgfence.token_shift(), pgfence.tag_shift(), pgfence.max_tag(),
                pgfence.sealed_sequence(), pgfence.sequence_step(), pgfence.max_token(),
                pgfence.token_fence(1) - 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        constants,
        (
            i32::try_from(StoredFence::TOKEN_SHIFT).unwrap(),
            i32::try_from(StoredFence::TAG_SHIFT).unwrap(),
            (1 << StoredFence::TAG_BITS) - 1,
            StoredFence::SEALED_SEQUENCE,
            StoredFence::SEQUENCE_STEP,
            pgfence::token::MAX_TOKEN,
            StoredFence::LOW_MASK,
        )
    );

    let fences = corner_fences();
    let raw: Vec<i64> = fences.iter().map(|f| f.get()).collect();
    type Parts = (i64, i64, i64, i64, i64, i64, i64, Option<i64>);
    let parts: Vec<Parts> = sqlx::query_as(
        "SELECT pgfence.fence_token(f), pgfence.fence_counter(f), pgfence.fence_holder(f),
                pgfence.fence_sequence(f), pgfence.fence_lease(f), pgfence.sealed_fence(f),
                pgfence.token_fence(pgfence.fence_token(f)), pgfence.next_step(f)
           FROM unnest($1::bigint[]) WITH ORDINALITY AS u(f, n) ORDER BY n",
    )
    .bind(&raw)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(parts.len(), fences.len());
    for (f, got) in fences.iter().zip(parts) {
        let expected: Parts = (
            f.token(),
            i64::from(f.counter()),
            i64::from(f.holder()),
            f.sequence(),
            f.lease_fence().get(),
            f.sealed().get(),
            StoredFence::first_of_token(f.token()).get(),
            f.next().map(StoredFence::get),
        );
        assert_eq!(got, expected, "fence {f:?}");
    }

    // A lease of every corner against every corner fence: the lease fence, other_counter and
    // next_fence's decision (stored fence, or PF001 / PF004 / PF005) agree with Rust. The
    // wrapper turns next_fence's error into its SQLSTATE.
    db.exec(
        "CREATE FUNCTION pgfence_test_next_fence(f bigint, t bigint, g integer,
             OUT fence bigint, OUT code text) LANGUAGE plpgsql AS $$
         BEGIN
             fence := pgfence.next_fence(f, t, g);
         EXCEPTION WHEN OTHERS THEN
             code := SQLSTATE;
         END $$",
    )
    .await;
    for lease in fences.iter().filter(|f| f.token() > 0 && f.sequence() == 0) {
        let tag = i32::from(lease.tag());
        let lease_fence: i64 = sqlx::query_scalar("SELECT pgfence.lease_fence($1, $2)")
            .bind(lease.token())
            .bind(tag)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(lease_fence, lease.get());
        let decided: Vec<(bool, Option<i64>, Option<String>)> = sqlx::query_as(
            "SELECT pgfence.other_counter(f, $2), r.fence, r.code
               FROM unnest($1::bigint[]) WITH ORDINALITY AS u(f, n),
                    LATERAL pgfence_test_next_fence(f, $3, $4) r ORDER BY n",
        )
        .bind(&raw)
        .bind(lease.get())
        .bind(lease.token())
        .bind(tag)
        .fetch_all(&db.pool)
        .await
        .unwrap();
        check_decisions(lease, &fences, &decided);
    }
}

fn check_decisions(
    lease: &StoredFence,
    fences: &[StoredFence],
    decided: &[(bool, Option<i64>, Option<String>)],
) {
    assert_eq!(decided.len(), fences.len());
    for (f, (other_counter, stored, code)) in fences.iter().zip(decided) {
        assert_eq!(
            *other_counter,
            f.other_counter(*lease),
            "{f:?} vs {lease:?}"
        );
        let expected = match f.relation_to(*lease) {
            Relation::Older => (Some(lease.get()), None),
            Relation::Own => (f.next().map(StoredFence::get), None),
            Relation::Newer { .. } => (None, Some("PF001")),
            Relation::Duplicate => (None, Some("PF004")),
            Relation::Sealed => (None, Some("PF005")),
        };
        // A token far above the row's is refused for its jump (PF008) before anything else.
        if code.as_deref() == Some("PF008") {
            assert!(lease.token() - f.token() > 1 << 36, "{f:?} vs {lease:?}");
            continue;
        }
        assert_eq!(
            (*stored, code.as_deref()),
            expected,
            "fence {f:?} met by lease {lease:?}"
        );
    }
}

/// The guard trigger's WHEN clause is literals only, and they are the layout's.
#[tokio::test]
async fn the_guard_trigger_carries_the_layout_as_literals() {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE t (id int PRIMARY KEY)").await;
    pgfence::guard::guard(&db.pool, &pgfence::table::TableName::parse("t").unwrap())
        .await
        .unwrap();
    let (def, jump): (String, i64) = sqlx::query_as(
        "SELECT pg_get_triggerdef(t.oid), pgfence.max_token_jump() FROM pg_trigger t
          WHERE t.tgname = 'pgfence_guard'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        !def.contains("pgfence.fence_") && !def.contains("pgfence.sequence_step"),
        "{def}"
    );
    for literal in [
        StoredFence::LOW_MASK,
        StoredFence::SEQUENCE_STEP,
        StoredFence::SEQUENCE_STEP - StoredFence::SEALED_SEQUENCE,
        jump << StoredFence::TOKEN_SHIFT,
    ] {
        assert!(def.contains(&literal.to_string()), "{literal} not in {def}");
    }
}
