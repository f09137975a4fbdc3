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
//! - 9d [`RedisIssuer`] acquire + release (3c), measured again next to 9a.
//!
//! The ZooKeeper server is a throwaway standalone server ([`ZkEnsemble::single`]: data on
//! `/dev/shm` when writable, `forceSync=no`) unless `PGFENCE_ZK_URL` names one
//! (`zk://host:port[,host:port...]`); its CPU per operation is read from `/proc/<pid>/stat` of
//! its JVM (local throwaway server only, warm-up included).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use pgfence::{RedisIssuer, Resource, issuer::ZkIssuer};
use pgfence_testkit::{ServerError, ZkEnsemble};
use zookeeper_client::{Acls, Client, CreateMode};

use crate::coord::{AcquireHeld, LocalServer, Server, release_held};
use crate::measure::{Outcome, Sample, Workload};
use crate::sections::{Results, measure_redis, put};
use crate::servers::{Env, prefix};
use crate::workloads::IssuerCycle;

/// The session timeout of the raw client (the issuer's default).
const SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// The ZooKeeper server of the run: a throwaway server (kept for every round), or
/// `PGFENCE_ZK_URL`.
pub(crate) type ZkServer = Server<ZkEnsemble>;

impl LocalServer for ZkEnsemble {
    const ENV: &'static str = "PGFENCE_ZK_URL";
    const NAME: &'static str = "ZooKeeper";
    const WHAT: &'static str = "throwaway standalone ZooKeeper";

    async fn start() -> std::result::Result<Self, ServerError> {
        ZkEnsemble::single(pgfence_testkit::optional::installed()?).await
    }

    fn url(&self) -> String {
        ZkEnsemble::url(self)
    }

    /// The ZooKeeper JVM (its CPU: all threads).
    fn pid(&self) -> Option<u32> {
        self.members().first()?.pid()
    }

    fn server_us_per_op(sample: &mut Sample) -> &mut Option<f64> {
        &mut sample.zk_server_us_per_op
    }
}

/// The connect string of a `zk://` URL (`host:port,...`), for the raw client: the scheme, a
/// trailing `/` and the query are dropped; a host without a port gets 2181.
fn hosts(url: &str) -> String {
    let rest = url.get(pgfence::issuer::zk::SCHEME.len()..).unwrap_or("");
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
        let owner = pgfence::Lease::new_owner_id();
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

/// Section `zk`: 9a–9d (9a and 9d: [`IssuerCycle`]; 9b: [`AcquireHeld`]).
pub(crate) async fn zk(
    env: &Env,
    server: &ZkServer,
    round: usize,
    out: &mut Results,
) -> Result<()> {
    let issuer = ZkIssuer::connect(server.url()).await?;
    // The raw client's own session: 9c, and the unmeasured cleanup of the issuer's lock dirs.
    let client = Client::connector()
        .with_session_timeout(SESSION_TIMEOUT)
        .connect(&hosts(server.url()))
        .await
        .context("raw zookeeper-client session")?;

    let cycle_prefix = prefix(env, "zk-cycle");
    let work = IssuerCycle {
        issuer: issuer.clone(),
        prefix: cycle_prefix.clone(),
    };
    let sample = server.measure(env, work).await?;
    put(out, round, "zk.issuer_cycle", sample);
    // Unmeasured: the (empty) lock dirs of 9a, so that ZooKeeper's container reaper does not
    // delete them during later figures.
    for task in 0..env.cfg.tasks {
        let resource = Resource::new(format!("{cycle_prefix}:{task}"))?;
        let _ = client.delete(&issuer.lock_dir(&resource), None).await;
    }

    let held = Arc::new(Mutex::new(Vec::new()));
    let work = AcquireHeld {
        issuer: issuer.clone(),
        prefix: prefix(env, "zk-fresh"),
        held: Arc::clone(&held),
    };
    let sample = server.measure(env, work).await?;
    put(out, round, "zk.issuer_fresh", sample);
    // Unmeasured: release what 9b took and delete its lock dirs, so that the timers, the nodes
    // and the container reaper do not load later figures (errors ignored: the leases expire
    // anyway, and the dirs are containers ZooKeeper reaps).
    let (releaser, deleter) = (issuer.clone(), client.clone());
    release_held(&held, env.cfg.tasks, move |lease| {
        let (issuer, client) = (releaser.clone(), deleter.clone());
        async move {
            let _ = issuer.release(&lease).await;
            let _ = client
                .delete(&issuer.lock_dir(lease.resource()), None)
                .await;
        }
    })
    .await;
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
    let sample = server.measure(env, work).await;
    // The parents (empty by now), whatever the measurement came to.
    for task in 0..env.cfg.tasks {
        let _ = client.delete(&format!("{base}/{task}"), None).await;
    }
    let _ = client.delete(&base, None).await;
    let _ = client.delete("/pgfence-bench", None).await;
    drop(client);
    put(out, round, "zk.raw_cycle", sample?);

    let work = IssuerCycle {
        issuer: RedisIssuer::connect(&env.redis_url).await?,
        prefix: prefix(env, "zk-vs-redis"),
    };
    let sample = measure_redis(env, work).await?;
    put(out, round, "zk.redis_cycle", sample);
    Ok(())
}
