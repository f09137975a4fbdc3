//! Setting a run up ([`Harness::new`]), running it ([`Harness::run`]), and steering it from
//! outside while it goes on ([`Control`]).

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgfence::{
    Effects, Fence, Repository, Resource, TokenIssuer,
    audit::Auditor,
    issuer::{IssuerKind, IssuerOptions},
    repository::{Coalescer, CoalescerStats},
};
use pgfence_testkit::{Provider, Proxy};
use redis::aio::ConnectionManager;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::time::Instant;

use crate::faults::{Kills, kill_backends};
use crate::leaseless::leaseless_writer;
use crate::nemesis::NemesisEvent;
use crate::schema::{self, Cell, ClaimCell, CoalescedCell};
use crate::util::{lock, millis};
use crate::verify::{ProviderTally, RunId, RunOutput, verify};
use crate::worker::{Plan, worker};
use crate::{
    AuditCounter, ChaosError, Config, FailoverEvent, FaultMark, Mode, PgFailoverEvent, Report,
    ReseedCounter, Target,
};

/// State the workers, the fault injectors and [`Control`] share.
pub(crate) struct Shared {
    /// When the run started (reset when the workers start).
    pub(crate) started: Mutex<Instant>,
    /// Units started.
    pub(crate) units: AtomicU64,
    /// Set when the workers stop.
    pub(crate) done: AtomicBool,
    /// Faults so far.
    pub(crate) faults: Mutex<Vec<FaultMark>>,
    /// The issuer failover, once recorded.
    pub(crate) failover: Mutex<Option<FailoverEvent>>,
    /// The database failover, once recorded.
    pub(crate) pg_failover: Mutex<Option<PgFailoverEvent>>,
    /// Faults in progress ([`Control::hold`]): the verification waits for them.
    pub(crate) held: AtomicU64,
    /// Nemesis actions so far (partitions, clock steps).
    pub(crate) nemesis: Mutex<Vec<NemesisEvent>>,
}

impl Shared {
    /// Milliseconds since the run started.
    pub(crate) fn now_ms(&self) -> u64 {
        millis(lock(&self.started).elapsed())
    }
}

/// What every worker needs.
pub(crate) struct Ctx {
    pub(crate) cfg: Config,
    /// The steps of a try in this run's mode.
    pub(crate) plan: Plan,
    /// The run id.
    pub(crate) run: String,
    /// One resource per counter row, by row (in batch mode, one per group of rows).
    pub(crate) resources: Vec<Resource>,
    /// The workers' pool (its backends may be killed).
    pub(crate) pool: PgPool,
    /// With [`Config::partitions`]: one pool per group of workers, each through its own
    /// proxy (worker `w` uses `group_pools[w % groups]`); empty otherwise.
    pub(crate) group_pools: Vec<PgPool>,
    pub(crate) fence: Fence,
    pub(crate) repo: Repository<Cell>,
    /// The same table, as the row-claim and batch modes claim and write it.
    pub(crate) claim_repo: Repository<ClaimCell>,
    /// With [`Config::coalesce`]: one coalescer per pool (by the same index as
    /// [`Ctx::pool_of`]), through which units send the updates they make outside a
    /// transaction; empty otherwise.
    pub(crate) coalescers: Vec<Coalescer<CoalescedCell>>,
    /// The last `w_nonce` handed out (see [`CoalescedCell`]).
    pub(crate) nonce: AtomicI64,
    /// The token issuer, whichever it is.
    pub(crate) issuer: Arc<dyn TokenIssuer>,
    /// For the counter resets (Redis through a `redis://` URL, only when the run resets).
    pub(crate) redis: Option<ConnectionManager>,
    /// The effects modes' ledger and payment provider.
    pub(crate) effects: Option<EffectsCtx>,
    /// Leaseless mode: the role the bypasses `SET LOCAL ROLE` to (`None`: the connecting role,
    /// allowed to bypass itself).
    pub(crate) bypass_role: Option<String>,
    pub(crate) shared: Arc<Shared>,
}

impl Ctx {
    /// The coalescer of worker `worker`'s pool (`None` without [`Config::coalesce`]).
    pub(crate) fn coalescer_of(&self, worker: usize) -> Option<&Coalescer<CoalescedCell>> {
        match self.coalescers.len() {
            0 => None,
            n => self.coalescers.get(worker % n),
        }
    }

    /// What the run's coalescers have done so far, summed (`None` without
    /// [`Config::coalesce`]).
    pub(crate) fn coalescer_stats(&self) -> Option<CoalescerStats> {
        if self.coalescers.is_empty() {
            return None;
        }
        let mut sum = CoalescerStats::default();
        for c in &self.coalescers {
            let s = c.stats();
            sum.alone += s.alone;
            sum.statements += s.statements;
            sum.carried += s.carried;
            sum.applied += s.applied;
            sum.resent += s.resent;
            sum.chained += s.chained;
        }
        Some(sum)
    }

    /// The pool worker `worker` writes through: its group's under partitions, else the
    /// workers' pool.
    pub(crate) fn pool_of(&self, worker: usize) -> &PgPool {
        if self.group_pools.is_empty() {
            &self.pool
        } else {
            &self.group_pools[worker % self.group_pools.len()]
        }
    }
}

/// What the effects modes' job needs besides the database: the effect ledger (sharing the
/// run's auditor) and the run's own payment provider on loopback.
pub(crate) struct EffectsCtx {
    pub(crate) ledger: Effects,
    pub(crate) provider: Provider,
    /// The provider's base URL.
    pub(crate) url: String,
}

/// A handle for injecting faults from outside while a run goes on.
#[derive(Clone)]
pub struct Control(Arc<Shared>);

impl Control {
    /// Work units started so far.
    #[must_use]
    pub fn units_started(&self) -> u64 {
        self.0.units.load(Ordering::SeqCst)
    }

    /// True once the workers have stopped.
    #[must_use]
    pub fn is_done(&self) -> bool {
        self.0.done.load(Ordering::SeqCst)
    }

    /// Waits until `n` units have started. Returns `false` if the run ended first.
    pub async fn wait_for_units(&self, n: u64) -> bool {
        loop {
            if self.units_started() >= n {
                return true;
            }
            if self.is_done() {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Records that a fault starts now; recovery is measured from this point. An issuer
    /// failover is the fault named `failover` (mark it once the old leader is dead: leases
    /// granted until then count as before it, leases asked for after it as after it), with
    /// its details in [`Control::record_failover`].
    pub fn mark_fault(&self, name: &str) {
        let mark = FaultMark {
            name: name.to_owned(),
            at_ms: self.0.now_ms(),
            at_unit: self.units_started(),
        };
        lock(&self.0.faults).push(mark);
    }

    /// Holds the run's verification back until the returned guard is dropped (at most 120 s
    /// after the workers stopped): a fault that changes the database under the run (a
    /// failover) must be over before the history is read back.
    #[must_use]
    pub fn hold(&self) -> FaultHold {
        self.0.held.fetch_add(1, Ordering::SeqCst);
        FaultHold(self.0.clone())
    }

    /// Milliseconds since the run started (the clock of every time in the report).
    #[must_use]
    pub fn now_ms(&self) -> u64 {
        self.0.now_ms()
    }

    /// Records what the database failover (the fault marked `pg_failover`) came to. The
    /// report's [`Summary::pg_failover`](crate::Summary::pg_failover) combines it with the
    /// history.
    pub fn record_pg_failover(&self, event: PgFailoverEvent) {
        *lock(&self.0.pg_failover) = Some(event);
    }

    /// Records what the issuer failover (the fault marked `failover`) came to: which leader
    /// died, which took over and when. The report's
    /// [`Summary::failover`](crate::Summary::failover) combines it with the tokens and writes
    /// around the mark.
    pub fn record_failover(&self, event: FailoverEvent) {
        *lock(&self.0.failover) = Some(event);
    }

    /// Records a nemesis action applied from outside (a clock step, see
    /// [`clock_steps`](crate::clock_steps)): it goes into the report's
    /// [`Summary::nemesis`](crate::Summary::nemesis) and the history file.
    pub fn record_nemesis(&self, event: NemesisEvent) {
        lock(&self.0.nemesis).push(event);
    }
}

/// A fault in progress ([`Control::hold`]); dropping it lets the verification go on.
pub struct FaultHold(Arc<Shared>);

impl Drop for FaultHold {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A prepared run. Build it with [`Harness::new`], take a [`Control`] if faults are injected
/// from outside, then [`Harness::run`].
pub struct Harness {
    ctx: Arc<Ctx>,
    admin: PgPool,
    audit: Arc<AuditCounter>,
    reseeds: Option<Arc<ReseedCounter>>,
    worker_app: String,
    /// The PostgreSQL issuer's application name (its backends are killed with the workers').
    issuer_app: Option<String>,
    /// With [`Config::partitions`]: each group's proxy in front of the database.
    proxies: Arc<Vec<Proxy>>,
}

impl Harness {
    /// Connects, applies pgfence's migrations if needed, creates the harness's tables (schema
    /// [`SCHEMA`](crate::SCHEMA), the fenced one guarded) and this run's counter rows.
    ///
    /// The issuer is picked by [`Target::issuer_url`]'s scheme
    /// ([`pgfence::issuer::connect_issuer_with`]) and used as an `Arc<dyn TokenIssuer>`. With Redis it
    /// gets the audit pool as its floor source when [`Config::recovery`] says so (etcd and
    /// ZooKeeper tokens never go backwards: nothing to reseed).
    ///
    /// The PostgreSQL issuer (`postgres://`, see [`Target::postgres`]) connects with the
    /// application name `pgfence-chaos-issuer-<run>` (added to its URL), so that with
    /// [`Config::kill_every`] its backends are terminated along with the workers': an acquire
    /// or release that loses its connection is re-sent with the same owner id. (The audit and
    /// admin pools are spared.) Restarting its server restarts the issuer too when it is the
    /// harness's database.
    ///
    /// Three pools are opened: the workers' (whose backends may be killed), an audit pool
    /// (used for audit rows and as the issuer's floor source, never killed) and an admin pool.
    /// Each run gets fresh rows keyed by its run id; the tables (and the run's audit rows) stay
    /// for inspection afterwards — `DROP SCHEMA pgfence_chaos CASCADE` removes them.
    ///
    /// The fence and the repositories share one [`Auditor`] whose sink is the run's
    /// [`AuditCounter`].
    ///
    /// # Errors
    /// [`ChaosError::Config`] for an inconsistent configuration, or one the issuer cannot do
    /// (counter resets need Redis through a `redis://` URL: refused for etcd, ZooKeeper and
    /// PostgreSQL); [`ChaosError::Fence`] when
    /// Postgres or the issuer cannot be reached or set up.
    pub async fn new(cfg: Config, target: &Target) -> Result<Self, ChaosError> {
        cfg.validate()?;
        if !cfg.reset_counters_at.is_empty() {
            check_counter_resets(&target.issuer_url)?;
        }
        let rows = i32::try_from(cfg.rows).map_err(|_| ChaosError::Config("rows".into()))?;
        let run = format!("{:016x}", rand::random::<u64>());
        let worker_app = format!("pgfence-chaos-worker-{run}");
        let leaseless_writers = if cfg.mode == Mode::LeaselessMix {
            cfg.leaseless_writers
        } else {
            0
        };
        let writers =
            u32::try_from(cfg.workers.saturating_add(leaseless_writers)).unwrap_or(u32::MAX);
        let pool = connect(target, &worker_app, writers.saturating_add(2)).await?;
        let (proxies, group_pools) = match &cfg.partitions {
            Some(p) => partition_pools(target, &worker_app, p.groups, cfg.workers).await?,
            None => (Vec::new(), Vec::new()),
        };
        let audit_pool = connect(target, "pgfence-chaos-audit", 4).await?;
        let admin = connect(target, "pgfence-chaos-admin", 2).await?;

        schema::setup(&admin, &run, rows).await?;
        let bypass_role = if cfg.mode == Mode::LeaselessMix {
            schema::setup_bypass_role(&admin).await?
        } else {
            None
        };

        let mut options = IssuerOptions::new();
        if cfg.recovery.floor_source {
            options = options.floor_source(audit_pool.clone());
        }
        if let Some(idle) = cfg.idle_expiry {
            options = options.idle_expiry(idle);
        }
        let issuer_app = (crate::issuer_of_url(&target.issuer_url) == Some(IssuerKind::Postgres))
            .then(|| format!("pgfence-chaos-issuer-{run}"));
        let issuer_url = match &issuer_app {
            Some(app) => with_application_name(&target.issuer_url, app),
            None => target.issuer_url.clone(),
        };
        let issuer = pgfence::issuer::connect_issuer_with(&issuer_url, options).await?;
        let redis = if cfg.reset_counters_at.is_empty() {
            None
        } else {
            let client = redis::Client::open(target.issuer_url.as_str())?;
            Some(ConnectionManager::new(client).await?)
        };
        let resources = (0..cfg.resource_count())
            .map(|i| match cfg.mode {
                Mode::Batch => Resource::new(format!("chaos:{run}:group{i}")),
                _ => Resource::new(format!("chaos:{run}:{i}")),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let audit = Arc::new(AuditCounter::new());
        let auditor = Auditor::new(audit_pool).sink(audit.clone());
        let fence = Fence::with_auditor(auditor.clone());
        let repo = Repository::<Cell>::with_auditor(auditor.clone())?;
        let claim_repo = Repository::<ClaimCell>::with_auditor(auditor.clone())?;
        let coalescers = if cfg.coalesce {
            let repo = Repository::<CoalescedCell>::with_auditor(auditor.clone())?;
            let pools = if group_pools.is_empty() {
                std::slice::from_ref(&pool)
            } else {
                &group_pools[..]
            };
            pools
                .iter()
                .map(|p| repo.clone().coalesced(p.clone()))
                .collect()
        } else {
            Vec::new()
        };
        let effects = if cfg.mode.calls_provider() {
            let provider = Provider::start(cfg.provider_latency)
                .map_err(|e| ChaosError::Config(format!("the payment provider: {e}")))?;
            Some(EffectsCtx {
                ledger: Effects::with_auditor(auditor),
                url: provider.url(),
                provider,
            })
        } else {
            None
        };
        let shared = Arc::new(Shared {
            started: Mutex::new(Instant::now()),
            units: AtomicU64::new(0),
            done: AtomicBool::new(false),
            faults: Mutex::new(Vec::new()),
            failover: Mutex::new(None),
            pg_failover: Mutex::new(None),
            held: AtomicU64::new(0),
            nemesis: Mutex::new(Vec::new()),
        });
        Ok(Self {
            ctx: Arc::new(Ctx {
                plan: Plan::of(cfg.mode),
                cfg,
                run,
                resources,
                pool,
                group_pools,
                fence,
                repo,
                claim_repo,
                coalescers,
                nonce: AtomicI64::new(0),
                issuer,
                redis,
                effects,
                bypass_role,
                shared,
            }),
            admin,
            audit,
            reseeds: None,
            worker_app,
            issuer_app,
            proxies: Arc::new(proxies),
        })
    }

    /// Counts the run's automatic reseeds with `counter` (see [`ReseedCounter`]); without
    /// one, `reseed_events` is reported as `null`.
    ///
    /// # Errors
    /// [`ChaosError::Config`] when the issuer never reseeds (etcd, ZooKeeper: their tokens
    /// cannot go backwards), so there is nothing to count.
    pub fn with_reseed_counter(mut self, counter: Arc<ReseedCounter>) -> Result<Self, ChaosError> {
        let kind = self.issuer_kind();
        if !kind.can_reseed() {
            return Err(ChaosError::Config(format!(
                "reseed counting is for Redis: the {kind} issuer's tokens never go backwards, \
                 it never reseeds"
            )));
        }
        self.reseeds = Some(counter);
        Ok(self)
    }

    /// Which issuer the run uses.
    #[must_use]
    pub fn issuer_kind(&self) -> IssuerKind {
        self.ctx.issuer.kind()
    }

    /// A handle for injecting faults while the run goes on.
    #[must_use]
    pub fn control(&self) -> Control {
        Control(self.ctx.shared.clone())
    }

    /// The run's id.
    #[must_use]
    pub fn run_id(&self) -> &str {
        &self.ctx.run
    }

    /// The prefix of every resource name of this run (`chaos:<run>:`; resources are
    /// `chaos:<run>:<row>`, or `chaos:<run>:group<g>` in batch mode).
    #[must_use]
    pub fn resource_prefix(&self) -> String {
        format!("chaos:{}:", self.ctx.run)
    }

    /// The counter of this run's audit events (live while it runs).
    #[must_use]
    pub fn audit_counter(&self) -> Arc<AuditCounter> {
        self.audit.clone()
    }

    /// Runs the workers (and the backend killer, if configured) to completion, then checks the
    /// history against what Postgres committed.
    ///
    /// # Errors
    /// [`ChaosError::Worker`] when a worker task panicked; [`ChaosError::Fence`] when the
    /// verification queries fail. Errors during the run are data, recorded in the report.
    pub async fn run(self) -> Result<Report, ChaosError> {
        let ctx = self.ctx.clone();
        let prefix = self.resource_prefix();
        let reseeds_before = self.reseeds.as_ref().map(|c| c.count(&prefix));
        // Restart the clock: setup time is not part of the run.
        let started = Instant::now();
        *lock(&ctx.shared.started) = started;
        let killer = ctx.cfg.kill_every.map(|every| {
            let admin = self.admin.clone();
            let app = self.worker_app.clone();
            let issuer_app = self.issuer_app.clone();
            let shared = ctx.shared.clone();
            let seed = ctx.cfg.seed;
            tokio::spawn(kill_backends(admin, app, issuer_app, shared, every, seed))
        });
        let partitioner = ctx.cfg.partitions.clone().map(|plan| {
            let proxies = self.proxies.clone();
            let shared = ctx.shared.clone();
            tokio::spawn(crate::nemesis::partition(
                proxies,
                plan,
                shared,
                ctx.cfg.seed,
            ))
        });
        let leaseless_ids = Arc::new(AtomicU64::new(0));
        let leaseless: Vec<_> = if ctx.cfg.mode == Mode::LeaselessMix {
            (0..ctx.cfg.leaseless_writers)
                .map(|w| {
                    let ids = leaseless_ids.clone();
                    tokio::spawn(leaseless_writer(w, ctx.clone(), ids, started))
                })
                .collect()
        } else {
            Vec::new()
        };
        let handles: Vec<_> = (0..ctx.cfg.workers)
            .map(|w| tokio::spawn(worker(w, ctx.clone(), started)))
            .collect();
        let mut workers = Vec::with_capacity(handles.len());
        for h in handles {
            match h.await {
                Ok(out) => workers.push(out),
                Err(e) => {
                    ctx.shared.done.store(true, Ordering::SeqCst);
                    return Err(ChaosError::Worker(e.to_string()));
                }
            }
        }
        ctx.shared.done.store(true, Ordering::SeqCst);
        let mut leaseless_attempts = Vec::new();
        for h in leaseless {
            match h.await {
                Ok(out) => leaseless_attempts.extend(out),
                Err(e) => return Err(ChaosError::Worker(e.to_string())),
            }
        }
        if let Some(p) = partitioner {
            let _ = p.await;
        }
        let kills = match killer {
            Some(k) => k.await.unwrap_or_default(),
            None => Kills::default(),
        };
        let duration_ms = millis(started.elapsed());
        // A fault still in progress (a failover) must finish before the history is read.
        let held_until = Instant::now() + Duration::from_secs(120);
        while ctx.shared.held.load(Ordering::SeqCst) > 0 && Instant::now() < held_until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Let audit writes that raced the end of the run land (each is bounded by its timeout).
        tokio::time::sleep(Duration::from_millis(50)).await;
        // Every call has returned (or timed out) by now: what the provider did.
        let provider = ctx.effects.as_ref().map(|fx| {
            let (requests, replays, conflicts) = fx.provider.counts();
            ProviderTally {
                requests,
                replays,
                conflicts,
                charges: fx.provider.all_charges(),
            }
        });
        let reseeds = self
            .reseeds
            .as_ref()
            .zip(reseeds_before)
            .map(|(c, before)| c.count(&prefix).saturating_sub(before));
        let output = RunOutput {
            workers,
            faults: lock(&ctx.shared.faults).clone(),
            failover: lock(&ctx.shared.failover).clone(),
            pg_failover: lock(&ctx.shared.pg_failover).clone(),
            kills,
            duration_ms,
            audit: self.audit.tally(&prefix),
            reseeds,
            provider,
            leaseless: leaseless_attempts,
            nemesis: lock(&ctx.shared.nemesis).clone(),
            partition_groups: self.proxies.len(),
            coalescer: ctx.coalescer_stats(),
        };
        let id = RunId {
            cfg: &ctx.cfg,
            issuer: ctx.issuer.kind(),
            run: &ctx.run,
            resource_prefix: &prefix,
        };
        let report = verify(&self.admin, id, output).await?;
        if let Some(path) = &ctx.cfg.history {
            report.write_history_file(path).map_err(|e| {
                ChaosError::Config(format!("writing the history to {}: {e}", path.display()))
            })?;
        }
        Ok(report)
    }
}

/// One proxy in front of the target database per group of workers, and each group's pool
/// through it (the workers' application name, so that killed backends include them).
async fn partition_pools(
    target: &Target,
    application_name: &str,
    groups: usize,
    workers: usize,
) -> Result<(Vec<Proxy>, Vec<PgPool>), ChaosError> {
    let host = target.database.get_host();
    if !matches!(host, "127.0.0.1" | "localhost") {
        return Err(ChaosError::Config(format!(
            "partitions put a loopback proxy in front of the database: it must be on \
             127.0.0.1 (not {host})"
        )));
    }
    let mut proxies = Vec::with_capacity(groups);
    let mut pools = Vec::with_capacity(groups);
    for g in 0..groups {
        let proxy = Proxy::start(target.database.get_port())
            .map_err(|e| ChaosError::Config(format!("starting a partition proxy: {e}")))?;
        let members = (g..workers).step_by(groups).count();
        let max = u32::try_from(members).unwrap_or(u32::MAX).saturating_add(2);
        let options = target
            .database
            .clone()
            .host("127.0.0.1")
            .port(proxy.port())
            .application_name(application_name);
        let pool = PgPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options)
            .await?;
        proxies.push(proxy);
        pools.push(pool);
    }
    Ok((proxies, pools))
}

/// A pool on the target database whose sessions carry `application_name`.
async fn connect(target: &Target, application_name: &str, max: u32) -> Result<PgPool, ChaosError> {
    Ok(PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(target.database.clone().application_name(application_name))
        .await?)
}

/// Counter resets `DEL` the counters on one Redis server: Redis only, and only through a
/// `redis://` URL (behind a `redis+sentinel://` URL the master moves). Checked before anything
/// is set up.
fn check_counter_resets(url: &str) -> Result<(), ChaosError> {
    match crate::issuer_of_url(url) {
        Some(IssuerKind::Redis) if pgfence::issuer::redis::is_sentinel_url(url) => {
            Err(ChaosError::Config(
                "counter resets need a redis:// URL (they DEL the counters on that server), not \
             redis+sentinel://"
                    .into(),
            ))
        }
        Some(IssuerKind::Redis) | None => Ok(()),
        Some(IssuerKind::Postgres) => Err(ChaosError::Config(
            "counter resets delete Redis counter keys: the postgres issuer has none, and its \
             counter rows commit with the fences, so they cannot go backwards (restart \
             PostgreSQL or kill backends instead)"
                .into(),
        )),
        Some(kind) => Err(ChaosError::Config(format!(
            "counter resets delete Redis counter keys: the {kind} issuer has none, and its \
             tokens cannot go backwards (fail its leader over instead)"
        ))),
    }
}

/// `url` with the connection parameter `application_name=<name>` added (sqlx takes the last
/// one given, so it wins over one already in the URL). `name` must be URL-safe.
fn with_application_name(url: &str, name: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}application_name={name}")
}
