//! The loads measured: pgfence's repository and issuer, and the same writes through raw sqlx.

use std::future::Future;
use std::time::Duration;

use pgfence::{Fencing, Lease, RedisIssuer, Repository, Resource, issuer::ReleaseOutcome};
use sqlx::{PgPool, SqlStr};

use crate::measure::{BatchKeys, Keys, Outcome, Workload, next_token, stale_token};
use crate::{LEASE_TTL, PAYLOAD};

/// A row of the guarded table, for the repository (`FromRow` for [`Repository::claim`]; the
/// `fence` column it also returns is ignored).
#[derive(Clone, Debug, sqlx::FromRow)]
pub(crate) struct GuardedRow {
    pub(crate) id: i32,
    pub(crate) payload: String,
}

pgfence::fenced_table!(GuardedRow {
    table: "bench_guarded",
    key: id: i32,
    columns: [payload],
});

/// A row of the job-cycle table (guarded, fences start at 0, tokens come from Redis).
#[derive(Clone, Debug)]
pub(crate) struct JobRow {
    id: i32,
    payload: String,
}

pgfence::fenced_table!(JobRow {
    table: "bench_jobs",
    key: id: i32,
    columns: [payload],
});

/// 1b: the plain update, on the unguarded table.
pub(crate) const PLAIN_UPDATE_SQL: &str = "UPDATE bench_plain SET payload = $1 WHERE id = $2";

/// 1d: the repository's fenced update as a person would write it (unquoted, unqualified), with
/// the repository's parameters: `$1` the key, `$2` the payload, `$3` the fence.
pub(crate) const FENCED_UPDATE_SQL: &str =
    "UPDATE bench_guarded SET payload = $2, fence = $3 WHERE id = $1 AND fence < $3";

/// 1a / 5 / 6: [`Repository::update`] on the guarded table. Every `stale_every`-th write (0:
/// none) presents token 1, which every row's fence has passed by the time it is used.
pub(crate) struct RepoWrite {
    pub(crate) pool: PgPool,
    pub(crate) repo: Repository<GuardedRow>,
    pub(crate) tasks: usize,
    pub(crate) rows: i32,
    pub(crate) stale_every: u64,
    /// Audit context (resource and holder) sent with every write, as an application would.
    pub(crate) context: Option<Resource>,
}

impl Workload for RepoWrite {
    type State = (Keys, GuardedRow, u64);

    fn state(&self, task: usize) -> Self::State {
        let row = GuardedRow {
            id: 0,
            payload: PAYLOAD.to_owned(),
        };
        (Keys::new(task, self.tasks, self.rows), row, 0)
    }

    async fn op(&self, (keys, row, n): &mut Self::State) -> Outcome {
        row.id = keys.next();
        *n += 1;
        let token = if self.stale_every > 0 && *n % self.stale_every == 0 {
            stale_token()
        } else {
            next_token()
        };
        let fencing = match &self.context {
            Some(r) => Fencing::new(token)
                .resource(r.clone())
                .holder("pgfence-bench"),
            None => Fencing::new(token),
        };
        self.repo.update(&self.pool, fencing, row).await.into()
    }
}

/// 13b: [`RepoWrite`]'s update through a [`pgfence::repository::Coalescer`]: concurrent
/// updates of fresh leases, coalesced when they queue up.
pub(crate) struct CoalescedWrite {
    pub(crate) writer: pgfence::repository::Coalescer<GuardedRow>,
    pub(crate) tasks: usize,
    pub(crate) rows: i32,
}

impl Workload for CoalescedWrite {
    type State = (Keys, GuardedRow);

    fn state(&self, task: usize) -> Self::State {
        let row = GuardedRow {
            id: 0,
            payload: PAYLOAD.to_owned(),
        };
        (Keys::new(task, self.tasks, self.rows), row)
    }

    async fn op(&self, (keys, row): &mut Self::State) -> Outcome {
        row.id = keys.next();
        self.writer
            .update(Fencing::new(next_token()), row)
            .await
            .into()
    }
}

/// 1f: a read-modify-write under one lease: [`Repository::claim`] the row (fences it and
/// reads it, one `UPDATE .. RETURNING *`), then [`Repository::update`] it with the same lease
/// (its second write of the row). Two statements per operation.
pub(crate) struct ClaimUpdate {
    pub(crate) pool: PgPool,
    pub(crate) repo: Repository<GuardedRow>,
    pub(crate) tasks: usize,
    pub(crate) rows: i32,
}

impl Workload for ClaimUpdate {
    type State = Keys;

    fn state(&self, task: usize) -> Self::State {
        Keys::new(task, self.tasks, self.rows)
    }

    async fn op(&self, keys: &mut Self::State) -> Outcome {
        let fencing = Fencing::new(next_token());
        let claimed: Result<GuardedRow, _> =
            self.repo.claim(&self.pool, &fencing, &keys.next()).await;
        let mut row = match claimed {
            Ok(row) => row,
            Err(e) => return Outcome::from(Err::<(), _>(e)),
        };
        row.payload.replace_range(.., PAYLOAD);
        self.repo.update(&self.pool, &fencing, &row).await.into()
    }
}

/// 7: [`Repository::update_many`] of `size` rows of the task's own rows (distinct, see
/// [`BatchKeys`]) with a fresh token per batch. An operation is a batch; it counts as applied
/// only when every row of it was.
pub(crate) struct BatchUpdate {
    pub(crate) pool: PgPool,
    pub(crate) repo: Repository<GuardedRow>,
    pub(crate) tasks: usize,
    pub(crate) rows: i32,
    pub(crate) size: usize,
}

impl Workload for BatchUpdate {
    type State = (BatchKeys, Vec<i32>, Vec<GuardedRow>);

    fn state(&self, task: usize) -> Self::State {
        let rows = (0..self.size)
            .map(|_| GuardedRow {
                id: 0,
                payload: PAYLOAD.to_owned(),
            })
            .collect();
        let keys = BatchKeys::new(task, self.tasks, self.rows, self.size);
        (keys, Vec::with_capacity(self.size), rows)
    }

    async fn op(&self, (keys, ids, rows): &mut Self::State) -> Outcome {
        keys.next(ids);
        for (row, id) in rows.iter_mut().zip(ids.iter()) {
            row.id = *id;
        }
        match self
            .repo
            .update_many(&self.pool, Fencing::new(next_token()), rows)
            .await
        {
            Ok(outcome) if outcome.all_applied() => Outcome::Applied,
            Ok(outcome) => {
                Outcome::Failed(format!("not every row applied: {:?}", outcome.summary()))
            }
            Err(e) if e.is_stale() => Outcome::Rejected,
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// 1b: the plain update on the unguarded table.
pub(crate) struct PlainUpdate {
    pub(crate) pool: PgPool,
    pub(crate) tasks: usize,
    pub(crate) rows: i32,
    /// 1g: in a transaction of its own, as the repository's write gate sends it (`BEGIN` with
    /// the two `SET LOCAL` bounds in one simple query, the `UPDATE`, `COMMIT`).
    pub(crate) gated: bool,
}

/// What the repository's write gate sends before a write bounded by the default 30 s (its
/// `BEGIN` and server-side bounds, one simple query).
const GATE_SQL: &str = "BEGIN; SET LOCAL statement_timeout = 30000; \
     SET LOCAL idle_in_transaction_session_timeout = 30000";

impl Workload for PlainUpdate {
    type State = (Keys, String);

    fn state(&self, task: usize) -> Self::State {
        (Keys::new(task, self.tasks, self.rows), PAYLOAD.to_owned())
    }

    async fn op(&self, (keys, payload): &mut Self::State) -> Outcome {
        let query = sqlx::query(PLAIN_UPDATE_SQL)
            .bind(&*payload)
            .bind(keys.next());
        let done = if self.gated {
            async {
                let mut tx = self.pool.begin_with(GATE_SQL).await?;
                let done = query.execute(&mut *tx).await?;
                tx.commit().await?;
                Ok(done)
            }
            .await
        } else {
            query.execute(&self.pool).await
        };
        match done {
            Ok(d) if d.rows_affected() == 1 => Outcome::Applied,
            Ok(_) => Outcome::Failed("no row updated".into()),
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// 1c / 1d: a fenced `UPDATE` sent by raw sqlx with the repository's parameters — the key
/// (`$1`), the payload (`$2`), then the one value the fence is compared with and set to, as
/// the repository computes it from a bare token
/// ([`Fencing::lease_fence`](pgfence::Fencing::lease_fence)) — running the repository's own
/// SQL text (1c, [`Repository::update_sql`], which also binds the lease's PostgreSQL
/// timeline) or the same statement written by hand (1d, no timeline).
pub(crate) struct RawFencedSql {
    pub(crate) pool: PgPool,
    pub(crate) sql: SqlStr,
    pub(crate) tasks: usize,
    pub(crate) rows: i32,
    /// The timeline 1c binds after the lease fence (as the repository does).
    pub(crate) timeline: Option<i64>,
}

impl Workload for RawFencedSql {
    type State = (Keys, String);

    fn state(&self, task: usize) -> Self::State {
        (Keys::new(task, self.tasks, self.rows), PAYLOAD.to_owned())
    }

    async fn op(&self, (keys, payload): &mut Self::State) -> Outcome {
        let mut query = sqlx::query(self.sql.clone())
            .bind(keys.next())
            .bind(&*payload)
            .bind(Fencing::from(next_token()).lease_fence());
        if let Some(timeline) = self.timeline {
            query = query.bind(timeline);
        }
        // The repository's statement also takes the fence the lease expects on the row (`$5`):
        // none for a fresh lease.
        if self.sql.as_str().contains("$5") {
            query = query.bind(0_i64);
        }
        let done = query.execute(&self.pool).await;
        match done {
            Ok(d) if d.rows_affected() == 1 => Outcome::Applied,
            Ok(_) => Outcome::Rejected,
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// 3a: one acquire per operation, each on a resource never used before (fresh lock key and
/// fresh counter, like `redis-benchmark` on random keys). Leases are left to expire.
pub(crate) struct AcquireFresh {
    pub(crate) issuer: RedisIssuer,
    pub(crate) prefix: String,
}

impl Workload for AcquireFresh {
    type State = (usize, u64);

    fn state(&self, task: usize) -> Self::State {
        (task, 0)
    }

    async fn op(&self, (task, seq): &mut Self::State) -> Outcome {
        *seq += 1;
        let resource = match Resource::new(format!("{}:{task}:{seq}", self.prefix)) {
            Ok(r) => r,
            Err(e) => return Outcome::Failed(e.to_string()),
        };
        match self.issuer.acquire(&resource, LEASE_TTL).await {
            Ok(Some(_)) => Outcome::Applied,
            Ok(None) => Outcome::Rejected,
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// An issuer the cycle loads drive: its own `acquire` and `release`, called directly (no
/// boxed futures).
pub(crate) trait CycleIssuer: Send + Sync + 'static {
    /// The issuer's `acquire`.
    fn acquire(
        &self,
        resource: &Resource,
        ttl: Duration,
    ) -> impl Future<Output = pgfence::Result<Option<Lease>>> + Send;

    /// The issuer's `release`.
    fn release(
        &self,
        lease: &Lease,
    ) -> impl Future<Output = pgfence::Result<ReleaseOutcome>> + Send;
}

impl<C> CycleIssuer for RedisIssuer<C>
where
    C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
{
    fn acquire(
        &self,
        resource: &Resource,
        ttl: Duration,
    ) -> impl Future<Output = pgfence::Result<Option<Lease>>> + Send {
        RedisIssuer::acquire(self, resource, ttl)
    }

    fn release(
        &self,
        lease: &Lease,
    ) -> impl Future<Output = pgfence::Result<ReleaseOutcome>> + Send {
        RedisIssuer::release(self, lease)
    }
}

/// 3c (and 8a, 9a): acquire + release of one resource per task.
pub(crate) struct IssuerCycle<I = RedisIssuer> {
    pub(crate) issuer: I,
    pub(crate) prefix: String,
}

impl<I: CycleIssuer> Workload for IssuerCycle<I> {
    type State = Resource;

    fn state(&self, task: usize) -> Self::State {
        Resource::new(format!("{}:{task}", self.prefix)).expect("valid resource name")
    }

    async fn op(&self, resource: &mut Self::State) -> Outcome {
        match self.issuer.acquire(resource, LEASE_TTL).await {
            Ok(Some(lease)) => match self.issuer.release(&lease).await {
                Ok(pgfence::issuer::ReleaseOutcome::Released) => Outcome::Applied,
                Ok(state) => Outcome::Failed(format!("release found {state:?}")),
                Err(e) => Outcome::Failed(e.to_string()),
            },
            Ok(None) => Outcome::Rejected,
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// 4: a job: acquire the task's resource, write one of its rows with the lease's token,
/// release.
pub(crate) struct JobCycle {
    pub(crate) issuer: RedisIssuer,
    pub(crate) pool: PgPool,
    pub(crate) repo: Repository<JobRow>,
    pub(crate) prefix: String,
    pub(crate) tasks: usize,
    pub(crate) rows: i32,
}

impl Workload for JobCycle {
    type State = (Keys, JobRow, Resource);

    fn state(&self, task: usize) -> Self::State {
        let row = JobRow {
            id: 0,
            payload: PAYLOAD.to_owned(),
        };
        let resource = Resource::new(format!("{}:{task}", self.prefix)).expect("valid name");
        (Keys::new(task, self.tasks, self.rows), row, resource)
    }

    async fn op(&self, (keys, row, resource): &mut Self::State) -> Outcome {
        let lease = match self.issuer.acquire(resource, LEASE_TTL).await {
            Ok(Some(lease)) => lease,
            Ok(None) => return Outcome::Failed("lock held".into()),
            Err(e) => return Outcome::Failed(e.to_string()),
        };
        row.id = keys.next();
        let written: Outcome = self.repo.update(&self.pool, &lease, row).await.into();
        match self.issuer.release(&lease).await {
            Ok(pgfence::issuer::ReleaseOutcome::Released) => written,
            Ok(state) => Outcome::Failed(format!("release found {state:?}")),
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}
