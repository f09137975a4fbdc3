//! `FenceLayer` driven directly as a tower service (no worker, no backend): what the handler
//! receives, what a run reports when a newer run superseded it, a busy lock, a missing layer.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use apalis_core::error::BoxDynError;
use apalis_core::layers::{Layer, Service};
use apalis_core::task::Task;
use apalis_core::task::builder::TaskBuilder;
use apalis_core::task::from_request::FromRequest;
use apalis_core::task::status::Status;
use apalis_core::task::task_fn::task_fn;
use apalis_core::task::task_id::TaskId;
use pgfence::issuer::PgIssuer;
use pgfence::{Fence, Resource};
use pgfence_apalis::{FenceError, FenceLayer, MissingLease, TaskLease, is_lease_lost};

use crate::support::TestDb;

const TTL: Duration = Duration::from_secs(5);

fn task<Args>(args: Args, id: &str) -> Task<Args> {
    TaskBuilder::new(args)
        .task_id(TaskId::from_string(id))
        .build()
}

fn layer(db: &TestDb) -> (Arc<PgIssuer>, FenceLayer) {
    let issuer = Arc::new(PgIssuer::new(db.pool.clone()));
    let layer = FenceLayer::new(issuer.clone(), db.pool.clone()).ttl(TTL);
    (issuer, layer)
}

async fn audit_ops(db: &TestDb) -> Vec<(String, i64, Option<i64>)> {
    sqlx::query_as("SELECT operation, presented, current FROM pgfence.audit ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

/// The handler gets a lease on `apalis:task:<id>` with the task id as work key; its effect
/// key is the same in every run of the task, each run has a newer token, the lease is
/// released afterwards, and a run nobody superseded keeps the handler's result and status.
#[tokio::test]
async fn each_run_has_a_newer_lease_and_the_same_effect_key() {
    let db = TestDb::new().await;
    let (issuer, layer) = layer(&db);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let handler = move |n: u32, lease: TaskLease| {
        let record = record.clone();
        async move {
            let effect = lease.begin_effect("charge").await?;
            let mut tx = lease.pool().begin().await?;
            lease.check(&mut *tx).await?;
            tx.commit().await?;
            record.lock().unwrap().push((
                lease.resource().as_str().to_owned(),
                lease.work_key().to_owned(),
                lease.token().get(),
                effect.idempotency_key().to_owned(),
            ));
            Ok::<_, BoxDynError>(n * 2)
        }
    };
    let mut svc = layer.layer(task_fn(handler));
    for _ in 0..2 {
        let t = task(21u32, "01JTASK0000000000000000001");
        let status = t.raw_status().clone();
        assert_eq!(svc.call(t).await.unwrap(), 42);
        assert_eq!(
            status.load(),
            Status::Pending,
            "the layer leaves a good run's status alone"
        );
    }
    let other = svc.call(task(1u32, "01JTASK0000000000000000002")).await;
    assert_eq!(other.unwrap(), 2);

    let seen = seen.lock().unwrap().clone();
    let (first, second, other) = (&seen[0], &seen[1], &seen[2]);
    assert_eq!(first.0, "apalis:task:01JTASK0000000000000000001");
    assert_eq!(first.1, "01JTASK0000000000000000001");
    assert!(second.2 > first.2, "a re-run has a newer token: {seen:?}");
    assert_eq!(first.3, second.3, "a re-run reuses the idempotency key");
    assert_ne!(first.3, other.3, "another task has its own key");
    // Released: the lock is free again.
    let resource = Resource::new(first.0.as_str()).unwrap();
    assert!(issuer.status(&resource).await.unwrap().owner.is_none());
    assert!(audit_ops(&db).await.is_empty());
}

/// A newer run starts while this one is paused; the zombie's write is refused, its handler
/// swallows the error and returns `Ok` anyway: the layer reports `LeaseLost` with status
/// `Failed`, not `Done`, and the refused final check is audited.
#[tokio::test]
async fn a_superseded_run_reports_failed_whatever_its_handler_returned() {
    let db = TestDb::new().await;
    let (issuer, layer) = layer(&db);
    let fence = Fence::new(db.pool.clone());
    let newer_token = Arc::new(Mutex::new(0));
    let newer = newer_token.clone();
    let handler = move |_: u32, lease: TaskLease| {
        let (issuer, fence, newer) = (issuer.clone(), fence.clone(), newer.clone());
        async move {
            // The pause: the lease runs out and a newer run of the task starts.
            issuer.release(lease.lease()).await?;
            let next = issuer.acquire(lease.resource(), TTL).await?.expect("free");
            fence.check(lease.pool(), lease.resource(), &next).await?;
            *newer.lock().unwrap() = next.token().get();
            // The zombie wakes up: its check is refused; it ignores that (a careless handler).
            let mut tx = lease.pool().begin().await?;
            let refused = lease.check(&mut *tx).await.unwrap_err();
            assert!(
                matches!(refused, pgfence::Error::StaleToken { .. }),
                "{refused:?}"
            );
            Ok::<_, BoxDynError>("done anyway")
        }
    };
    let mut svc = layer.layer(task_fn(handler));
    let t = task(7u32, "01JTASK0000000000000000003");
    let status = t.raw_status().clone();
    let err = svc.call(t).await.unwrap_err();
    assert!(is_lease_lost(&*err), "{err}");
    let Some(FenceError::LeaseLost {
        token,
        current,
        task_id,
        handler_error,
        ..
    }) = err.downcast_ref::<FenceError>()
    else {
        panic!("{err:?}")
    };
    let newer = *newer_token.lock().unwrap();
    assert_eq!(*current, Some(newer));
    assert!(*token < newer);
    assert_eq!(task_id, "01JTASK0000000000000000003");
    assert!(handler_error.is_none());
    assert_eq!(status.load(), Status::Failed, "never Done for a zombie");
    let ops: Vec<String> = audit_ops(&db).await.into_iter().map(|a| a.0).collect();
    assert_eq!(
        ops,
        ["check", "check"],
        "the handler's check and the final one"
    );
}

/// One lease per account: two tasks of one account share the resource (and are serialised),
/// their effect keys stay per task.
#[tokio::test]
async fn a_resource_function_gives_one_lease_per_account() {
    #[derive(Clone)]
    struct Charge {
        account: i64,
    }
    let db = TestDb::new().await;
    let (_, layer) = layer(&db);
    let layer = layer.resource(|task: &Task<Charge>| {
        Resource::new(format!("billing:account:{}", task.args.account))
    });
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let handler = move |_: Charge, lease: TaskLease| {
        let record = record.clone();
        async move {
            let effect = lease.begin_effect("charge").await?;
            record.lock().unwrap().push((
                lease.resource().as_str().to_owned(),
                effect.idempotency_key().to_owned(),
            ));
            tokio::time::sleep(Duration::from_millis(100)).await;
            Ok::<_, BoxDynError>(())
        }
    };
    let mut one = layer.clone().layer(task_fn(handler.clone()));
    let mut two = layer.layer(task_fn(handler));
    let (a, b) = tokio::join!(
        one.call(task(Charge { account: 7 }, "01JTASK0000000000000000004")),
        two.call(task(Charge { account: 7 }, "01JTASK0000000000000000005")),
    );
    a.unwrap();
    b.unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen[0].0, "billing:account:7");
    assert_eq!(seen[1].0, "billing:account:7");
    assert_ne!(seen[0].1, seen[1].1, "one key per task");
}

/// Another run holds the lock for longer than the wait: `Busy`, the handler does not run,
/// status `Failed`.
#[tokio::test]
async fn a_held_lock_is_busy_and_the_handler_does_not_run() {
    let db = TestDb::new().await;
    let (issuer, layer) = layer(&db);
    let layer = layer.wait(Duration::from_millis(200));
    let held = issuer
        .acquire(
            &Resource::new("apalis:task:01JTASK0000000000000000006").unwrap(),
            TTL,
        )
        .await
        .unwrap()
        .unwrap();
    let ran = Arc::new(Mutex::new(false));
    let flag = ran.clone();
    let handler = move |_: u32, _: TaskLease| {
        let flag = flag.clone();
        async move {
            *flag.lock().unwrap() = true;
            Ok::<_, BoxDynError>(())
        }
    };
    let t = task(1u32, "01JTASK0000000000000000006");
    let status = t.raw_status().clone();
    let err = layer.layer(task_fn(handler)).call(t).await.unwrap_err();
    assert!(
        matches!(
            err.downcast_ref::<FenceError>(),
            Some(FenceError::Busy { .. })
        ),
        "{err:?}"
    );
    assert!(!is_lease_lost(&*err));
    assert!(!*ran.lock().unwrap());
    assert_eq!(status.load(), Status::Failed);
    issuer.release(&held).await.unwrap();
}

/// A handler that asks for a `TaskLease` on a worker without the layer gets a clear error.
#[tokio::test]
async fn without_the_layer_a_handler_gets_a_clear_error() {
    let t = task(1u32, "01JTASK0000000000000000007");
    let err = TaskLease::from_request(&t).await.unwrap_err();
    assert_eq!(err, MissingLease);
    assert!(err.to_string().contains("FenceLayer"));
}
