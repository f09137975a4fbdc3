//! Section `zk` (feature `zk`): pgfence's [`ZkIssuer`] next to a raw zookeeper-client loop
//! through a session of its own (the ceiling) and the Redis issuer, in the same run.
//!
//! - 9a `ZkIssuer::acquire` + `release` of one resource per task: a listing of the resource's
//!   lock dir, the create of an ephemeral sequential node `lock-<owner>-`, a listing again;
//!   then a listing, a stat and the delete (6 requests, 2 of them writes), plus the lease's
//!   local timer task.
//! - 9b `ZkIssuer::acquire` of a fresh resource each time (the leases are released and their
//!   lock dirs deleted after the measurement, unmeasured, so that their timers, nodes and
//!   ZooKeeper's container reaper do not load later figures).
//! - 9c raw zookeeper-client, its own session: create an ephemeral sequential node under a
//!   per-task persistent parent (created beforehand), delete it: 2 requests, both writes —
//!   the least a ZooKeeper lock can cost.
//! - 9d the Redis [`Issuer`] acquire + release (3c), measured again next to 9a.
//!
//! The ZooKeeper server is a throwaway standalone server ([`ZkEnsemble::single`]: data on
//! `/dev/shm` when writable, `forceSync=no`) unless `PGFENCE_ZK_URL` names one
//! (`zk://host:port[,host:port...]`); its CPU per operation is read from `/proc/<pid>/stat` of
//! its JVM (local throwaway server only, warm-up included).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use pgfence::{Issuer, Lease, Resource, ZkIssuer};
use pgfence_testkit::ZkEnsemble;
use zookeeper_client::{Acls, Client, CreateMode};

use crate::LEASE_TTL;
use crate::measure::{Metric, Outcome, Sample, Workload, measure};
use crate::sections::{Results, measure_redis, put};
use crate::servers::{Env, prefix};
use crate::workloads::IssuerCycle;

/// The session timeout of the raw client (the issuer's default).
const SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// The ZooKeeper server of the run: a throwaway server (kept for every round), or
/// `PGFENCE_ZK_URL`.
pub(crate) struct ZkServer {
    /// Kept alive for the run; `None` for `PGFENCE_ZK_URL`.
    ensemble: Option<ZkEnsemble>,
    url: String,
}

impl ZkServer {
    /// `PGFENCE_ZK_URL`, or a throwaway standalone server.
    pub(crate) async fn start() -> Result<Self> {
        if let Some(url) = std::env::var("PGFENCE_ZK_URL")
            .ok()
            .filter(|u| !u.trim().is_empty())
        {
            return Ok(Self {
                ensemble: None,
                url,
            });
        }
        let ensemble = ZkEnsemble::single()
            .await
            .context("starting a throwaway ZooKeeper (or set PGFENCE_ZK_URL)")?;
        let url = ensemble.url();
        Ok(Self {
            ensemble: Some(ensemble),
            url,
        })
    }

    /// Where it came from, for the progress output.
    pub(crate) fn describe(&self) -> String {
        match &self.ensemble {
            Some(_) => format!("throwaway standalone ZooKeeper at {}", self.url),
            None => format!("PGFENCE_ZK_URL {}", self.url),
        }
    }

    /// The ZooKeeper JVM's CPU ticks (user + system, all threads) so far, for a local
    /// throwaway server.
    fn ticks(&self) -> Option<u64> {
        let pid = self.ensemble.as_ref()?.members().first()?.pid()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        pgfence_bench::parse_proc_stat(&stat).map(|(_, own, _)| own)
    }

    /// The connect string of the URL (`host:port,...`), for the raw client: the scheme, a
    /// trailing `/` and the query are dropped; a host without a port gets 2181.
    fn hosts(&self) -> String {
        let rest = self.url.get(pgfence::ZK_SCHEME.len()..).unwrap_or("");
        let hosts = rest.split('?').next().unwrap_or("");
        hosts
            .trim_end_matches('/')
            .split(',')
            .map(|h| {
                if h.ends_with(']') || !h.contains(':') {
                    format!("{h}:2181")
                } else {
                    h.to_owned()
                }
            })
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Microseconds per `USER_HZ` tick.
const TICK_US: f64 = 10_000.0;

/// Runs `work` like [`measure`], and also reads the ZooKeeper server's CPU per operation.
async fn measure_zk<W: Workload>(env: &Env, server: &ZkServer, work: W) -> Result<Sample> {
    let before = server.ticks();
    let mut sample = measure(&env.cfg, env.cfg.tasks, Metric::Applied, work).await?;
    let after = server.ticks();
    if let (Some(a), Some(b)) = (before, after)
        && sample.total_ops > 0
    {
        sample.zk_server_us_per_op =
            Some(b.saturating_sub(a) as f64 * TICK_US / sample.total_ops as f64);
    }
    Ok(sample)
}

/// 9a: `ZkIssuer` acquire + release of one resource per task.
struct ZkCycle {
    issuer: ZkIssuer,
    prefix: String,
}

impl Workload for ZkCycle {
    type State = Resource;

    fn state(&self, task: usize) -> Self::State {
        Resource::new(format!("{}:{task}", self.prefix)).expect("valid resource name")
    }

    async fn op(&self, resource: &mut Self::State) -> Outcome {
        match self.issuer.acquire(resource, LEASE_TTL).await {
            Ok(Some(lease)) => match self.issuer.release(&lease).await {
                Ok(pgfence::ReleaseOutcome::Released) => Outcome::Applied,
                Ok(state) => Outcome::Failed(format!("release found {state:?}")),
                Err(e) => Outcome::Failed(e.to_string()),
            },
            Ok(None) => Outcome::Rejected,
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// 9b: `ZkIssuer::acquire` of a fresh resource; the leases are kept for a release after the
/// measurement.
struct ZkAcquireFresh {
    issuer: ZkIssuer,
    prefix: String,
    held: Arc<Mutex<Vec<Lease>>>,
}

impl Workload for ZkAcquireFresh {
    type State = (usize, u64);

    fn state(&self, task: usize) -> Self::State {
        (task, 0)
    }

    async fn op(&self, (task, n): &mut Self::State) -> Outcome {
        *n += 1;
        let resource = match Resource::new(format!("{}:{task}:{n}", self.prefix)) {
            Ok(r) => r,
            Err(e) => return Outcome::Failed(e.to_string()),
        };
        match self.issuer.acquire(&resource, LEASE_TTL).await {
            Ok(Some(lease)) => {
                self.held.lock().expect("not poisoned").push(lease);
                Outcome::Applied
            }
            Ok(None) => Outcome::Rejected,
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// 9c: the raw ceiling through a session of its own: create an ephemeral sequential node
/// under the task's parent (named and filled like the issuer's: `lock-<owner>-`, the owner
/// id as data), delete it.
struct RawZkCycle {
    client: Client,
    /// The parents' parent: task `i`'s parent is `{base}/{i}`.
    base: String,
}

impl Workload for RawZkCycle {
    /// The node's name before its sequence, and its data (the owner id).
    type State = (String, String);

    fn state(&self, task: usize) -> Self::State {
        let owner = pgfence::new_owner_id();
        (format!("{}/{task}/lock-{owner}-", self.base), owner)
    }

    async fn op(&self, (stem, owner): &mut Self::State) -> Outcome {
        let mode = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
        let run = async {
            let (_, sequence) = self
                .client
                .create(stem.as_str(), owner.as_bytes(), &mode)
                .await?;
            self.client.delete(&format!("{stem}{sequence}"), None).await
        };
        match run.await {
            Ok(()) => Outcome::Applied,
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// Section `zk`: 9a–9d.
pub(crate) async fn zk(
    env: &Env,
    server: &ZkServer,
    round: usize,
    out: &mut Results,
) -> Result<()> {
    let issuer = ZkIssuer::connect(&server.url).await?;
    // The raw client's own session: 9c, and the unmeasured cleanup of the issuer's lock dirs.
    let client = Client::connector()
        .with_session_timeout(SESSION_TIMEOUT)
        .connect(&server.hosts())
        .await
        .context("raw zookeeper-client session")?;

    let cycle_prefix = prefix(env, "zk-cycle");
    let work = ZkCycle {
        issuer: issuer.clone(),
        prefix: cycle_prefix.clone(),
    };
    let sample = measure_zk(env, server, work).await?;
    put(out, round, "zk.issuer_cycle", sample);
    // Unmeasured: the (empty) lock dirs of 9a, so that ZooKeeper's container reaper does not
    // delete them during later figures.
    for task in 0..env.cfg.tasks {
        let resource = Resource::new(format!("{cycle_prefix}:{task}"))?;
        let _ = client.delete(&issuer.lock_dir(&resource), None).await;
    }

    let held = Arc::new(Mutex::new(Vec::new()));
    let work = ZkAcquireFresh {
        issuer: issuer.clone(),
        prefix: prefix(env, "zk-fresh"),
        held: Arc::clone(&held),
    };
    let sample = measure_zk(env, server, work).await?;
    put(out, round, "zk.issuer_fresh", sample);
    // Unmeasured: release what 9b took and delete its lock dirs, so that the timers, the nodes
    // and the container reaper do not load later figures.
    let leases = std::mem::take(&mut *held.lock().expect("not poisoned"));
    release_all(&issuer, &client, leases, env.cfg.tasks).await;
    drop(issuer);

    let base = format!("/pgfence-bench/{}", prefix(env, "zk-raw"));
    let parent = CreateMode::Persistent.with_acls(Acls::anyone_all());
    for task in 0..env.cfg.tasks {
        client.mkdir(&format!("{base}/{task}"), &parent).await?;
    }
    let work = RawZkCycle {
        client: client.clone(),
        base: base.clone(),
    };
    let sample = measure_zk(env, server, work).await;
    // The parents (empty by now), whatever the measurement came to.
    for task in 0..env.cfg.tasks {
        let _ = client.delete(&format!("{base}/{task}"), None).await;
    }
    let _ = client.delete(&base, None).await;
    let _ = client.delete("/pgfence-bench", None).await;
    drop(client);
    put(out, round, "zk.raw_cycle", sample?);

    let work = IssuerCycle {
        issuer: Issuer::connect(&env.redis_url).await?,
        prefix: prefix(env, "zk-vs-redis"),
    };
    let sample = measure_redis(env, work).await?;
    put(out, round, "zk.redis_cycle", sample);
    Ok(())
}

/// Releases `leases` on `tasks` tasks and deletes their lock dirs through `client` (errors
/// ignored: the leases expire anyway, and the dirs are containers ZooKeeper reaps).
async fn release_all(issuer: &ZkIssuer, client: &Client, leases: Vec<Lease>, tasks: usize) {
    let leases = Arc::new(Mutex::new(leases));
    let handles: Vec<_> = (0..tasks.max(1))
        .map(|_| {
            let (issuer, client, leases) = (issuer.clone(), client.clone(), Arc::clone(&leases));
            tokio::spawn(async move {
                loop {
                    let next = leases.lock().expect("not poisoned").pop();
                    let Some(lease) = next else { break };
                    let _ = issuer.release(&lease).await;
                    let _ = client
                        .delete(&issuer.lock_dir(lease.resource()), None)
                        .await;
                }
            })
        })
        .collect();
    for h in handles {
        let _ = h.await;
    }
}
