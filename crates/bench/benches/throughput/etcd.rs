//! Section `etcd` (feature `etcd`): pgfence's [`EtcdIssuer`] next to a raw etcd-client loop
//! through the same client (the ceiling) and the Redis issuer, in the same run.
//!
//! - 8a `EtcdIssuer::acquire` + `release` of one resource per task: a read, a lease grant, the
//!   create-if-absent transaction; then the compare-and-delete transaction and the lease
//!   revoke (5 requests, 4 of them Raft writes).
//! - 8b `EtcdIssuer::acquire` of a fresh resource each time (the leases are released after
//!   the measurement, unmeasured, so that their expiry does not load later figures).
//! - 8c raw etcd-client, same client: lease grant, create-if-absent transaction putting the
//!   key under the lease, lease revoke (which deletes the key): 3 requests, all Raft writes.
//! - 8d the Redis [`Issuer`] acquire + release (3c), measured again next to 8a.
//!
//! The etcd server is a throwaway single node ([`EtcdCluster::single`], data on `/dev/shm`
//! when writable) unless `PGFENCE_ETCD_URL` names one (`etcd://host:port`); its CPU per
//! operation is read from `/proc/<pid>/stat` (local throwaway server only, warm-up included).

use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use pgfence::{EtcdIssuer, Issuer, Lease, Resource};
use pgfence_testkit::EtcdCluster;

use crate::LEASE_TTL;
use crate::measure::{Metric, Outcome, Sample, Workload, measure};
use crate::sections::{Results, measure_redis, put};
use crate::servers::{Env, prefix};
use crate::workloads::IssuerCycle;

/// The etcd server of the run: a throwaway node (kept for every round), or `PGFENCE_ETCD_URL`.
pub(crate) struct EtcdServer {
    /// Kept alive for the run; `None` for `PGFENCE_ETCD_URL`.
    cluster: Option<EtcdCluster>,
    url: String,
}

impl EtcdServer {
    /// `PGFENCE_ETCD_URL`, or a throwaway single node.
    pub(crate) async fn start() -> Result<Self> {
        if let Some(url) = std::env::var("PGFENCE_ETCD_URL")
            .ok()
            .filter(|u| !u.trim().is_empty())
        {
            return Ok(Self { cluster: None, url });
        }
        let cluster = EtcdCluster::single()
            .await
            .context("starting a throwaway etcd (or set PGFENCE_ETCD_URL)")?;
        let url = cluster.url();
        Ok(Self {
            cluster: Some(cluster),
            url,
        })
    }

    /// Where it came from, for the progress output.
    pub(crate) fn describe(&self) -> String {
        match &self.cluster {
            Some(_) => format!("throwaway single-node etcd at {}", self.url),
            None => format!("PGFENCE_ETCD_URL {}", self.url),
        }
    }

    /// The etcd server's CPU ticks (user + system) so far, for a local throwaway server.
    fn ticks(&self) -> Option<u64> {
        let pid = self.cluster.as_ref()?.members().first()?.pid()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        pgfence_bench::parse_proc_stat(&stat).map(|(_, own, _)| own)
    }
}

/// Microseconds per `USER_HZ` tick.
const TICK_US: f64 = 10_000.0;

/// Runs `work` like [`measure`], and also reads the etcd server's CPU per operation.
async fn measure_etcd<W: Workload>(env: &Env, server: &EtcdServer, work: W) -> Result<Sample> {
    let before = server.ticks();
    let mut sample = measure(&env.cfg, env.cfg.tasks, Metric::Applied, work).await?;
    let after = server.ticks();
    if let (Some(a), Some(b)) = (before, after)
        && sample.total_ops > 0
    {
        sample.etcd_server_us_per_op =
            Some(b.saturating_sub(a) as f64 * TICK_US / sample.total_ops as f64);
    }
    Ok(sample)
}

/// 8a: `EtcdIssuer` acquire + release of one resource per task.
struct EtcdCycle {
    issuer: EtcdIssuer,
    prefix: String,
}

impl Workload for EtcdCycle {
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

/// 8b: `EtcdIssuer::acquire` of a fresh resource; the leases are kept for a release after the
/// measurement.
struct EtcdAcquireFresh {
    issuer: EtcdIssuer,
    prefix: String,
    held: Arc<Mutex<Vec<Lease>>>,
}

impl Workload for EtcdAcquireFresh {
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

/// 8c: the raw ceiling through the issuer's client: grant, create-if-absent put under the
/// lease, revoke.
struct RawEtcdCycle {
    client: etcd_client::Client,
    prefix: String,
}

impl Workload for RawEtcdCycle {
    type State = String;

    fn state(&self, task: usize) -> Self::State {
        format!("{}/raw/{task}", self.prefix)
    }

    async fn op(&self, key: &mut Self::State) -> Outcome {
        let secs = i64::try_from(LEASE_TTL.as_secs()).unwrap_or(30);
        let run = async {
            let mut leases = self.client.lease_client();
            let id = leases.grant(secs, None).await?.id();
            let txn = Txn::new()
                .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(
                    key.as_str(),
                    "owner",
                    Some(PutOptions::new().with_lease(id)),
                )]);
            let reply = self.client.kv_client().txn(txn).await?;
            leases.revoke(id).await?;
            Ok::<bool, etcd_client::Error>(reply.succeeded())
        };
        match run.await {
            Ok(true) => Outcome::Applied,
            Ok(false) => Outcome::Rejected,
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// Section `etcd`: 8a–8d.
pub(crate) async fn etcd(
    env: &Env,
    server: &EtcdServer,
    round: usize,
    out: &mut Results,
) -> Result<()> {
    let issuer = EtcdIssuer::connect(&server.url).await?;

    let work = EtcdCycle {
        issuer: issuer.clone(),
        prefix: prefix(env, "etcd-cycle"),
    };
    let sample = measure_etcd(env, server, work).await?;
    put(out, round, "etcd.issuer_cycle", sample);

    let held = Arc::new(Mutex::new(Vec::new()));
    let work = EtcdAcquireFresh {
        issuer: issuer.clone(),
        prefix: prefix(env, "etcd-fresh"),
        held: Arc::clone(&held),
    };
    let sample = measure_etcd(env, server, work).await?;
    put(out, round, "etcd.issuer_fresh", sample);
    // Unmeasured: release what 8b took, so that the leases do not expire during later figures.
    let leases = std::mem::take(&mut *held.lock().expect("not poisoned"));
    release_all(&issuer, leases, env.cfg.tasks).await;

    let work = RawEtcdCycle {
        client: issuer.client().clone(),
        prefix: format!("{}/bench/{}", issuer.key_prefix(), prefix(env, "etcd-raw")),
    };
    let sample = measure_etcd(env, server, work).await?;
    put(out, round, "etcd.raw_cycle", sample);

    let work = IssuerCycle {
        issuer: Issuer::connect(&env.redis_url).await?,
        prefix: prefix(env, "etcd-vs-redis"),
    };
    let sample = measure_redis(env, work).await?;
    put(out, round, "etcd.redis_cycle", sample);
    Ok(())
}

/// Releases `leases` on `tasks` tasks (errors ignored: the leases expire anyway).
async fn release_all(issuer: &EtcdIssuer, leases: Vec<Lease>, tasks: usize) {
    let leases = Arc::new(Mutex::new(leases));
    let handles: Vec<_> = (0..tasks.max(1))
        .map(|_| {
            let (issuer, leases) = (issuer.clone(), Arc::clone(&leases));
            tokio::spawn(async move {
                loop {
                    let next = leases.lock().expect("not poisoned").pop();
                    let Some(lease) = next else { break };
                    let _ = issuer.release(&lease).await;
                }
            })
        })
        .collect();
    for h in handles {
        let _ = h.await;
    }
}
