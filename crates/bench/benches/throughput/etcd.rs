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
//! - 8d [`RedisIssuer`] acquire + release (3c), measured again next to 8a.
//!
//! The etcd server is a throwaway single node ([`EtcdCluster::single`], data on `/dev/shm`
//! when writable) unless `PGFENCE_ETCD_URL` names one (`etcd://host:port`); its CPU per
//! operation is read from `/proc/<pid>/stat` (local throwaway server only, warm-up included).

use std::sync::{Arc, Mutex};

use anyhow::Result;
use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use pgfence::{RedisIssuer, issuer::EtcdIssuer};
use pgfence_testkit::{EtcdCluster, ServerError};

use crate::LEASE_TTL;
use crate::coord::{AcquireHeld, LocalServer, Server, release_held};
use crate::measure::{Outcome, Sample, Workload};
use crate::sections::{Results, measure_redis, put};
use crate::servers::{Env, prefix};
use crate::workloads::IssuerCycle;

/// The etcd server of the run: a throwaway node (kept for every round), or `PGFENCE_ETCD_URL`.
pub(crate) type EtcdServer = Server<EtcdCluster>;

impl LocalServer for EtcdCluster {
    const ENV: &'static str = "PGFENCE_ETCD_URL";
    const NAME: &'static str = "etcd";
    const WHAT: &'static str = "throwaway single-node etcd";

    async fn start() -> std::result::Result<Self, ServerError> {
        EtcdCluster::single(pgfence_testkit::optional::installed()?).await
    }

    fn url(&self) -> String {
        EtcdCluster::url(self)
    }

    fn pid(&self) -> Option<u32> {
        self.members().first()?.pid()
    }

    fn server_us_per_op(sample: &mut Sample) -> &mut Option<f64> {
        &mut sample.etcd_server_us_per_op
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

/// Section `etcd`: 8a–8d (8a and 8d: [`IssuerCycle`]; 8b: [`AcquireHeld`]).
pub(crate) async fn etcd(
    env: &Env,
    server: &EtcdServer,
    round: usize,
    out: &mut Results,
) -> Result<()> {
    let issuer = EtcdIssuer::connect(server.url()).await?;

    let work = IssuerCycle {
        issuer: issuer.clone(),
        prefix: prefix(env, "etcd-cycle"),
    };
    let sample = server.measure(env, work).await?;
    put(out, round, "etcd.issuer_cycle", sample);

    let held = Arc::new(Mutex::new(Vec::new()));
    let work = AcquireHeld {
        issuer: issuer.clone(),
        prefix: prefix(env, "etcd-fresh"),
        held: Arc::clone(&held),
    };
    let sample = server.measure(env, work).await?;
    put(out, round, "etcd.issuer_fresh", sample);
    // Unmeasured: release what 8b took, so that the leases do not expire during later figures
    // (errors ignored: the leases expire anyway).
    let releaser = issuer.clone();
    release_held(&held, env.cfg.tasks, move |lease| {
        let issuer = releaser.clone();
        async move {
            let _ = issuer.release(&lease).await;
        }
    })
    .await;

    let work = RawEtcdCycle {
        client: issuer.client().clone(),
        prefix: format!("{}/bench/{}", issuer.key_prefix(), prefix(env, "etcd-raw")),
    };
    let sample = server.measure(env, work).await?;
    put(out, round, "etcd.raw_cycle", sample);

    let work = IssuerCycle {
        issuer: RedisIssuer::connect(&env.redis_url).await?,
        prefix: prefix(env, "etcd-vs-redis"),
    };
    let sample = measure_redis(env, work).await?;
    put(out, round, "etcd.redis_cycle", sample);
    Ok(())
}
