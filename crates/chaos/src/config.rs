//! What a run does ([`Config`], [`Mode`], fault settings, [`Recovery`]) and where it runs
//! ([`Target`]).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use pgfence::issuer::IssuerKind;
use serde::Serialize;
use sqlx::postgres::PgConnectOptions;

use crate::ChaosError;
use crate::nemesis::Partitions;

/// How the workers protect their read-modify-write (see the [crate documentation](crate)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// `Fence::check` + read + fenced update in one transaction: token order and no lost
    /// updates.
    Fenced,
    /// One lease, 2–3 transactions, each `Fence::check` + read + fenced increment: the lease is
    /// a session of work; token order and no lost updates.
    FencedMulti,
    /// One lease: `Repository::claim` (fences the row and reads it), then 2–4 fenced updates
    /// (the first increments) over 1–3 transactions: token order and no lost updates without a
    /// resource check.
    RowClaim,
    /// One lease per group of rows: `Repository::claim_many` of 10–100 of the group's rows
    /// (fences them and reads their values), then one `Repository::update_many` writing each
    /// claimed row's value + 1, with one outcome per row: token order and no lost updates per
    /// row, whatever mix of applied and stale rows a batch gets.
    Batch,
    /// A job with a side effect outside PostgreSQL: claim the row (its next invoice), record
    /// the charge in the effect ledger ([`pgfence::Effects::begin`]), call a payment provider
    /// over HTTP with the ledger's idempotency key, then record the outcome
    /// ([`pgfence::Effects::finish`]) and mark the invoice paid (fenced increment) in one
    /// transaction: token order and no lost updates in the database, and no invoice charged
    /// twice at the provider, whatever zombie calls late.
    Effects,
    /// [`Mode::RowClaim`]'s leases (claim, then 2–4 fenced updates over 1–3 transactions,
    /// stalls past the TTL) with lease-less writers on the same rows
    /// ([`Config::leaseless_writers`]): raw updates that set `fence = fence + 1` (and
    /// `value = value + 1`), which the guard must refuse every time, and audited bypasses
    /// (`SELECT pgfence.bypass(reason)`, then `value = value + 1`, as an allowed role), which
    /// go through and seal the row, so the lease that claimed it before gets
    /// [`RowSealed`](pgfence::Error::RowSealed) instead of overwriting the bypass: no lost
    /// update of either kind.
    #[serde(rename = "leaseless")]
    LeaselessMix,
    /// Read, then a fenced row update: token order per row, but lost updates remain possible.
    RowFence,
    /// Read, then a plain `UPDATE ... SET value = $1` on an unguarded table: the control.
    Unfenced,
    /// [`Mode::Effects`] with the classic mistake: the provider call's idempotency key is made
    /// from the item and the lease's token (`<item>-<token>`), not taken from the ledger, so a
    /// zombie and the holder that took its work over send different keys: the control that
    /// must show invoices charged twice.
    EffectsUnkeyed,
}

impl Mode {
    /// Every mode, in the order `--all-modes` runs them (the controls last).
    pub const ALL: [Mode; 9] = [
        Mode::Fenced,
        Mode::FencedMulti,
        Mode::RowClaim,
        Mode::Batch,
        Mode::Effects,
        Mode::LeaselessMix,
        Mode::RowFence,
        Mode::Unfenced,
        Mode::EffectsUnkeyed,
    ];

    /// Whether the mode must show no violation *and* no lost update (the row fence alone only
    /// promises token order; the unfenced control promises nothing).
    #[must_use]
    pub fn prevents_lost_updates(self) -> bool {
        matches!(
            self,
            Mode::Fenced
                | Mode::FencedMulti
                | Mode::RowClaim
                | Mode::Batch
                | Mode::Effects
                | Mode::LeaselessMix
                | Mode::EffectsUnkeyed
        )
    }

    /// Whether the mode's job calls the payment provider ([`Mode::Effects`],
    /// [`Mode::EffectsUnkeyed`]): its report has [`Summary::effects`](crate::Summary::effects).
    #[must_use]
    pub fn calls_provider(self) -> bool {
        matches!(self, Mode::Effects | Mode::EffectsUnkeyed)
    }

    /// Whether the mode's units write through [`pgfence::repository::Coalescer`] with
    /// [`Config::coalesce`]: the modes whose fencing is in the row itself
    /// ([`Mode::RowClaim`], [`Mode::LeaselessMix`]), so that a fenced update on its own, outside
    /// any transaction of the unit, is as safe as one inside it.
    #[must_use]
    pub fn can_coalesce(self) -> bool {
        matches!(self, Mode::RowClaim | Mode::LeaselessMix)
    }

    /// Why [`Config::coalesce`] is refused for this mode (for a mode that
    /// [`can_coalesce`](Mode::can_coalesce), an empty string).
    #[must_use]
    pub fn why_not_coalesced(self) -> &'static str {
        match self {
            Mode::RowClaim | Mode::LeaselessMix => "",
            Mode::Fenced | Mode::FencedMulti => {
                "coalesce: the fenced modes' write must share the transaction of their \
                 `Fence::check` and read (the check's lock on the resource is what keeps a newer \
                 lease from reading before this write lands), and a coalesced update runs in a \
                 transaction of its own: if the check's transaction ended first (a killed \
                 connection, a timeout), a newer lease could read the old value, the queued \
                 write land after, and the newer lease's write lose it. Use --mode row-claim \
                 (the claim fences the row itself)"
            }
            Mode::Batch => {
                "coalesce: batch units write many rows in one update_many already; the \
                 coalescer is for single-row updates"
            }
            Mode::Effects | Mode::EffectsUnkeyed => {
                "coalesce: the effects modes' write shares a transaction with the ledger's \
                 finish, which a coalesced update cannot join"
            }
            Mode::RowFence | Mode::Unfenced => {
                "coalesce: the row-fence and unfenced controls write after a plain read, which \
                 nothing fences; coalescing would prove nothing"
            }
        }
    }

    /// The control run next to this mode (`--control`): [`Mode::EffectsUnkeyed`] for
    /// [`Mode::Effects`], [`Mode::Unfenced`] for the database modes, `None` for a control.
    #[must_use]
    pub fn control(self) -> Option<Mode> {
        match self {
            Mode::Unfenced | Mode::EffectsUnkeyed => None,
            Mode::Effects => Some(Mode::EffectsUnkeyed),
            _ => Some(Mode::Unfenced),
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fenced" | "tx" => Ok(Mode::Fenced),
            "fenced-multi" | "fenced_multi" | "multi" => Ok(Mode::FencedMulti),
            "row-claim" | "row_claim" | "claim" => Ok(Mode::RowClaim),
            "batch" => Ok(Mode::Batch),
            "row-fence" | "row_fence" | "row" => Ok(Mode::RowFence),
            "unfenced" | "none" => Ok(Mode::Unfenced),
            "effects" => Ok(Mode::Effects),
            "leaseless" | "leaseless-mix" | "leaseless_mix" => Ok(Mode::LeaselessMix),
            "effects-unkeyed" | "effects_unkeyed" | "unkeyed" => Ok(Mode::EffectsUnkeyed),
            other => Err(format!(
                "unknown mode {other:?} (expected fenced, fenced-multi, row-claim, batch, \
                 effects, leaseless, row-fence, unfenced or effects-unkeyed)"
            )),
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Fenced => "fenced",
            Mode::FencedMulti => "fenced-multi",
            Mode::RowClaim => "row-claim",
            Mode::Batch => "batch",
            Mode::RowFence => "row-fence",
            Mode::Unfenced => "unfenced",
            Mode::Effects => "effects",
            Mode::LeaselessMix => "leaseless",
            Mode::EffectsUnkeyed => "effects-unkeyed",
        })
    }
}

/// How workers restore liveness after the Redis counter went backwards.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Recovery {
    /// Give the issuer a floor source ([`pgfence::RedisIssuer::with_floor_source`]): an acquire
    /// that finds the counter missing reseeds it from Postgres's high-water mark by itself.
    pub floor_source: bool,
    /// After a rejected write, call [`pgfence::RedisIssuer::recover_from`], which raises the
    /// counter to the fence the write met (a no-op when the rejection was an ordinary stale
    /// holder).
    pub recover_from: bool,
}

/// What a run does. [`Config::default`] is a CI-sized fenced run.
///
/// The workload: `workers`, `rows`, `units`, `ttl`, `acquire_wait`, `retries`. The faults the
/// harness injects by itself: stalls (`pause_*`), counter loss (`reset_counters_at`, Redis
/// only) and killed backends (`kill_every`); server restarts and issuer failovers are
/// injected by the caller through a [`Control`](crate::Control) (see
/// [`Deployment`](crate::Deployment)). [`Config::for_issuer`] adapts the lease timing to the
/// issuer.
#[derive(Clone, Debug)]
pub struct Config {
    /// Protection used by the workers.
    pub mode: Mode,
    /// Concurrent workers.
    pub workers: usize,
    /// Counter rows (each with its own resource, lock and token counter; in batch mode the
    /// rows are split into `batch_groups` groups, one resource each).
    pub rows: usize,
    /// Work units: leases that go on to write (retries of a unit are extra attempts).
    pub units: u64,
    /// Lease TTL.
    pub ttl: Duration,
    /// How long a worker waits for a busy lock before giving up on that unit.
    pub acquire_wait: Duration,
    /// Probability that a unit stalls once: before its read or between read and write; in the
    /// multi-statement modes before any one of its statements (between transactions or inside
    /// one).
    pub pause_probability: f64,
    /// Shortest injected stall (make it longer than `ttl` so the lease expires).
    pub pause_min: Duration,
    /// Longest injected stall.
    pub pause_max: Duration,
    /// Retries of a unit, with the same lease, after an error that
    /// [`pgfence::Error::is_retryable`] calls safe to retry.
    pub retries: u32,
    /// Beyond `retries`: keep retrying a unit's retryable failures (same lease, 20–60 ms
    /// apart) until this long after its first try started, as a job does that retries its
    /// write through a database outage. A PostgreSQL failover run sets it
    /// ([`pg_failover_at`](crate::pg_failover_at)): the units caught by the outage come back
    /// after the promotion with leases from before it — the zombies pgfence must fence out.
    pub outage_retry: Option<Duration>,
    /// Delete every row's Redis counter when the unit with this index starts (a failover that
    /// lost the counters). Redis only, through a `redis://` URL: [`Harness::new`](crate::Harness::new)
    /// refuses it for etcd, ZooKeeper and PostgreSQL, whose tokens cannot be reset.
    pub reset_counters_at: Vec<u64>,
    /// Idle expiry of the issuer's counters ([`pgfence::RedisIssuer::with_idle_expiry`],
    /// [`pgfence::issuer::PgIssuer::with_idle_expiry`]): a row's counter that no lease used
    /// for this long past the last lease's TTL expires while the other rows' leases run, and
    /// the row's next lease is re-created above the floor (or healed by `recover_from`).
    /// `None`: counters are kept (the issuer's default).
    pub idle_expiry: Option<Duration>,
    /// Terminate one busy worker backend (`pg_terminate_backend`) about this often; with the
    /// PostgreSQL issuer also one of the issuer's own backends each time (see
    /// [`Harness::new`](crate::Harness::new)).
    pub kill_every: Option<Duration>,
    /// Liveness recovery after counter loss (Redis: etcd, ZooKeeper and PostgreSQL tokens
    /// never go backwards, their `raise_floor` and `recover_from` are no-ops).
    pub recovery: Recovery,
    /// Wall-clock bound: workers stop starting units after this long.
    pub max_duration: Duration,
    /// Seed of the workers' random choices.
    pub seed: u64,
    /// Batch mode: how many groups (one resource, lock and token counter each) the rows are
    /// split into, as evenly as possible in contiguous ranges.
    pub batch_groups: usize,
    /// Batch mode: fewest rows a unit writes (fewer when its group is smaller).
    pub batch_min_rows: usize,
    /// Batch mode: most rows a unit writes (at most its group's rows).
    pub batch_max_rows: usize,
    /// Effects modes: how long the payment provider takes to answer a charge (a call in
    /// flight that long is what a concurrent duplicate with the same key meets: `409`).
    pub provider_latency: Duration,
    /// Leaseless mode: lease-less writers running next to the workers, each on random rows.
    pub leaseless_writers: usize,
    /// Leaseless mode: the mean pause between two writes of one lease-less writer (drawn
    /// uniformly from zero to twice this).
    pub leaseless_every: Duration,
    /// Leaseless mode: the share of lease-less writes that are audited bypasses (the others
    /// are raw `fence = fence + 1` updates).
    pub bypass_share: f64,
    /// Network partitions between groups of workers and PostgreSQL (see [`Partitions`]);
    /// `None`: every worker on one pool, straight to the database.
    pub partitions: Option<Partitions>,
    /// Where to write the run's history as JSON lines (see
    /// [`Report::write_history`](crate::Report::write_history)), once the run is verified.
    pub history: Option<PathBuf>,
    /// Send the fenced updates a unit makes outside a transaction through one shared
    /// [`pgfence::repository::Coalescer`] per pool (concurrent units' updates become one statement when
    /// they queue up). [`Mode::RowClaim`] and [`Mode::LeaselessMix`] only
    /// ([`Mode::can_coalesce`]): their scripts then put each update in a transaction of its
    /// own half of the time, and such a write goes through the coalescer; its history row is
    /// written by a trigger in the coalesced statement itself, so it commits with the write.
    pub coalesce: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            mode: Mode::Fenced,
            workers: 8,
            rows: 8,
            units: 2_000,
            ttl: Duration::from_millis(40),
            acquire_wait: Duration::from_secs(2),
            pause_probability: 0.05,
            pause_min: Duration::from_millis(60),
            pause_max: Duration::from_millis(120),
            retries: 2,
            outage_retry: None,
            reset_counters_at: Vec::new(),
            idle_expiry: None,
            kill_every: None,
            recovery: Recovery {
                floor_source: true,
                recover_from: true,
            },
            max_duration: Duration::from_secs(120),
            seed: 0x5eed,
            batch_groups: 1,
            batch_min_rows: 10,
            batch_max_rows: 100,
            provider_latency: Duration::from_millis(10),
            leaseless_writers: 2,
            leaseless_every: Duration::from_millis(4),
            bypass_share: 0.5,
            partitions: None,
            history: None,
            coalesce: false,
        }
    }
}

impl Config {
    /// [`Config::default`] with the lease timing suited to `issuer`: a 40 ms TTL and stalls of
    /// 60–120 ms for Redis, ZooKeeper and PostgreSQL (whose issuers end a lock when its TTL
    /// runs out, to the millisecond; PostgreSQL's by the database's clock, from the acquire
    /// statement, so a lease's local deadline never outlasts it); for etcd, whose leases count
    /// whole seconds (and whose servers expire them on a 500 ms tick), a 1 s TTL, stalls of
    /// 1.6–2.4 s (past the lock's real end) and a 4 s acquire wait.
    #[must_use]
    pub fn for_issuer(issuer: IssuerKind) -> Self {
        let default = Self::default();
        if issuer == IssuerKind::Etcd {
            Self {
                ttl: Duration::from_secs(1),
                pause_min: Duration::from_millis(1_600),
                pause_max: Duration::from_millis(2_400),
                acquire_wait: Duration::from_secs(4),
                ..default
            }
        } else {
            default
        }
    }

    /// Checks that the settings are consistent.
    pub(crate) fn validate(&self) -> Result<(), ChaosError> {
        let bad = |m: &str| Err(ChaosError::Config(m.to_owned()));
        if self.workers == 0 {
            return bad("workers must be at least 1");
        }
        if self.rows == 0 || i32::try_from(self.rows).is_err() {
            return bad("rows must be in 1..=i32::MAX");
        }
        if !(0.0..=1.0).contains(&self.pause_probability) {
            return bad("pause probability must be in 0..=1");
        }
        if self.pause_min > self.pause_max {
            return bad("pause_min must not exceed pause_max");
        }
        if self.mode == Mode::Batch {
            if self.batch_groups == 0 || self.batch_groups > self.rows {
                return bad("batch groups must be in 1..=rows");
            }
            if self.batch_min_rows == 0 || self.batch_min_rows > self.batch_max_rows {
                return bad("batch rows: need 1 <= min <= max");
            }
            if self.batch_max_rows > pgfence::repository::MAX_BATCH_ROWS {
                return bad("batch rows: at most pgfence::repository::MAX_BATCH_ROWS per unit");
            }
        }
        if self.mode == Mode::LeaselessMix {
            if self.leaseless_writers == 0 {
                return bad("leaseless mode: need at least one lease-less writer");
            }
            if !(0.0..=1.0).contains(&self.bypass_share) {
                return bad("bypass share must be in 0..=1");
            }
        }
        if self.mode.calls_provider() && self.provider_latency > Duration::from_secs(10) {
            return bad("provider latency: at most 10 s");
        }
        if self
            .outage_retry
            .is_some_and(|d| d > Duration::from_secs(120))
        {
            return bad("outage retry: at most 120 s");
        }
        if let Some(p) = &self.partitions {
            p.validate(self.workers).map_err(ChaosError::Config)?;
        }
        if self.coalesce && !self.mode.can_coalesce() {
            return Err(ChaosError::Config(self.mode.why_not_coalesced().to_owned()));
        }
        pgfence::issuer::limits::check_ttl(self.ttl)?;
        Ok(())
    }

    /// Batch mode: the counter rows of `group` (contiguous, groups as even as possible).
    pub(crate) fn group_rows(&self, group: usize) -> std::ops::Range<i32> {
        let groups = self.batch_groups.max(1);
        let bound = |g: usize| i32::try_from(self.rows * g / groups).unwrap_or(i32::MAX);
        bound(group)..bound(group + 1)
    }

    /// The resources (one lock and token counter each) the workers lease: one per row, or in
    /// batch mode one per group of rows.
    pub(crate) fn resource_count(&self) -> usize {
        if self.mode == Mode::Batch {
            self.batch_groups
        } else {
            self.rows
        }
    }
}

/// Where the harness runs: a Postgres database (pgfence's migrations are applied if missing)
/// and a token issuer.
#[derive(Clone, Debug)]
pub struct Target {
    /// The database.
    pub database: PgConnectOptions,
    /// The issuer's URL; its scheme picks the issuer ([`pgfence::issuer::connect_issuer_with`]):
    /// `redis://` (also `rediss://`, `redis+unix://`), `redis+sentinel://host:port,.../master`,
    /// `etcd://host:port,...`, `zk://host:port,...`, or `postgres://` / `postgresql://` for
    /// the [`PgIssuer`](pgfence::issuer::PgIssuer) — meant to be `database` itself
    /// ([`Target::postgres`]), so that its restarts and killed backends hit the issuer too.
    pub issuer_url: String,
}

impl Target {
    /// The harness on the database at `database_url` with the PostgreSQL issuer on that same
    /// database (no other server): `issuer_url` is `database_url`.
    ///
    /// # Errors
    /// [`ChaosError::Config`] when `database_url` is not a `postgres://` or `postgresql://`
    /// URL or does not parse (the URL is not echoed: it may hold a password).
    pub fn postgres(database_url: &str) -> Result<Self, ChaosError> {
        if pgfence::issuer::IssuerKind::of_url(database_url).ok()
            != Some(pgfence::issuer::IssuerKind::Postgres)
        {
            return Err(ChaosError::Config(
                "the postgres issuer takes the database's postgres:// or postgresql:// URL".into(),
            ));
        }
        let database = database_url
            .parse::<PgConnectOptions>()
            .map_err(|_| ChaosError::Config("the database URL does not parse".into()))?;
        Ok(Self {
            database,
            issuer_url: database_url.to_owned(),
        })
    }
}
