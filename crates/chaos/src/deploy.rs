//! Throwaway issuer deployments ([`Deployment`]) and the one fault that needs several issuer
//! processes: a real failover ([`Deployment::failover_at`]).

use std::time::Duration;

use pgfence::issuer::IssuerKind;
use pgfence_testkit::optional::{Etcd, Sentinel, ZooKeeper, installed};
use pgfence_testkit::{EtcdCluster, SentinelConfig, SentinelSet, Server, ZkEnsemble};
use tokio::time::Instant;

use crate::util::millis;
use crate::verify::FAILOVER;
use crate::{ChaosError, Control, FailoverEvent};

/// The name the sentinels of a failover deployment monitor the master under.
const SENTINEL_MASTER: &str = "pgfence-chaos";

/// How long a failover may take to elect a new leader (or promote the replica).
const ELECTION_TIMEOUT: Duration = Duration::from_secs(60);

/// Parses an issuer name: `redis`, `etcd`, `zk` (also `zookeeper`) or `postgres` (also
/// `postgresql`, `pg`).
///
/// # Errors
/// The name of no issuer.
pub fn parse_issuer(name: &str) -> Result<IssuerKind, String> {
    match name.to_ascii_lowercase().as_str() {
        "redis" => Ok(IssuerKind::Redis),
        "etcd" => Ok(IssuerKind::Etcd),
        "zk" | "zookeeper" => Ok(IssuerKind::ZooKeeper),
        "postgres" | "postgresql" | "pg" => Ok(IssuerKind::Postgres),
        other => Err(format!(
            "unknown issuer {other:?} (expected redis, etcd, zk or postgres)"
        )),
    }
}

/// The issuer `url`'s scheme selects, as [`pgfence::issuer::connect_issuer_with`] picks it (`None`
/// for a scheme it does not know).
#[must_use]
pub fn issuer_of_url(url: &str) -> Option<IssuerKind> {
    IssuerKind::of_url(url).ok()
}

/// The issuer's servers for a run, started from the installed binaries (`pgfence-testkit`):
///
/// | issuer | single ([`Deployment::start`] without failover) | for a failover |
/// |---|---|---|
/// | Redis | one `redis-server` (restartable: it comes back empty) | a master, one replica and three sentinels (quorum 2, down after 1 s): `redis+sentinel://` |
/// | etcd | one member | three members |
/// | ZooKeeper | one standalone server | an ensemble of three |
///
/// The PostgreSQL issuer has no deployment: it runs on the harness's own database
/// ([`Target::postgres`](crate::Target::postgres)), whose restarts are the caller's (a
/// throwaway [`Server`]); [`Deployment::start`] refuses it.
///
/// Dropping it stops every process and removes their directories.
#[derive(Debug)]
pub struct Deployment(Servers);

#[derive(Debug)]
enum Servers {
    Redis(Server),
    Sentinel(SentinelSet),
    Etcd(EtcdCluster),
    Zk(ZkEnsemble),
}

impl Deployment {
    /// Starts `issuer`'s servers: one server, or with `for_failover` the replicated deployment
    /// a [`Deployment::failover_at`] needs.
    ///
    /// # Errors
    /// [`ChaosError::Server`] when the binaries are missing or the servers do not come up;
    /// [`ChaosError::Config`] for an issuer this harness does not know.
    pub async fn start(issuer: IssuerKind, for_failover: bool) -> Result<Self, ChaosError> {
        let servers = match (issuer, for_failover) {
            (IssuerKind::Redis, false) => Servers::Redis(Server::redis().await?),
            (IssuerKind::Redis, true) => {
                let config = SentinelConfig {
                    replicas: 1,
                    sentinels: 3,
                    quorum: 2,
                    down_after: Duration::from_millis(1_000),
                    failover_timeout: Duration::from_secs(3),
                };
                Servers::Sentinel(
                    SentinelSet::start(installed::<Sentinel>()?, SENTINEL_MASTER, config).await?,
                )
            }
            (IssuerKind::Etcd, failover) => Servers::Etcd(
                EtcdCluster::start(installed::<Etcd>()?, if failover { 3 } else { 1 }).await?,
            ),
            (IssuerKind::ZooKeeper, failover) => Servers::Zk(
                ZkEnsemble::start(installed::<ZooKeeper>()?, if failover { 3 } else { 1 }).await?,
            ),
            (IssuerKind::Postgres, _) => {
                return Err(ChaosError::Config(
                    "the postgres issuer has no servers of its own: it runs on the harness's \
                     database (Target::postgres); fail that database over with \
                     pg_failover_at"
                        .into(),
                ));
            }
            (other, _) => {
                return Err(ChaosError::Config(format!(
                    "no throwaway deployment for the {other} issuer"
                )));
            }
        };
        Ok(Self(servers))
    }

    /// The issuer the servers are for.
    #[must_use]
    pub fn issuer(&self) -> IssuerKind {
        match &self.0 {
            Servers::Redis(_) | Servers::Sentinel(_) => IssuerKind::Redis,
            Servers::Etcd(_) => IssuerKind::Etcd,
            Servers::Zk(_) => IssuerKind::ZooKeeper,
        }
    }

    /// The issuer URL ([`Target::issuer_url`](crate::Target::issuer_url)): `redis://`,
    /// `redis+sentinel://`, `etcd://` or `zk://`.
    #[must_use]
    pub fn url(&self) -> String {
        match &self.0 {
            Servers::Redis(s) => s.url(),
            Servers::Sentinel(s) => s.url(),
            Servers::Etcd(c) => c.url(),
            Servers::Zk(z) => z.url(),
        }
    }

    /// Whether [`Deployment::failover_at`] can fail this deployment over (it was started for
    /// one).
    #[must_use]
    pub fn can_fail_over(&self) -> bool {
        match &self.0 {
            Servers::Redis(_) => false,
            Servers::Sentinel(_) => true,
            Servers::Etcd(c) => c.members().len() >= 3,
            Servers::Zk(z) => z.members().len() >= 3,
        }
    }

    /// The Redis server of a single Redis deployment (for a restart), `None` otherwise.
    pub fn redis_server(&mut self) -> Option<&mut Server> {
        match &mut self.0 {
            Servers::Redis(s) => Some(s),
            _ => None,
        }
    }

    /// The current leader (etcd member, ZooKeeper server) or master, as named in a
    /// [`FailoverEvent`]; `None` while none is known. Asks the servers (a few milliseconds,
    /// blocking).
    #[must_use]
    pub fn leader(&self) -> Option<String> {
        match &self.0 {
            Servers::Redis(s) => Some(format!("127.0.0.1:{}", s.port())),
            Servers::Sentinel(s) => s.master_port().map(|p| format!("127.0.0.1:{p}")),
            Servers::Etcd(c) => c.leader().map(|i| etcd_name(c, i)),
            Servers::Zk(z) => z.leader().map(|i| zk_name(z, i)),
        }
    }

    /// A real failover of the issuer once `at_unit` units have started, recorded in the run
    /// through `ctl` (the fault named `failover`, marked as soon as the old leader's process is
    /// gone, then [`Control::record_failover`]):
    ///
    /// * etcd, ZooKeeper: `SIGKILL` of the leader (the member every running member names);
    ///   the run goes on against the two survivors, which elect a new leader.
    /// * Redis: at unit `at_unit - replica_lag` the replica is paused (`SIGSTOP`) and the
    ///   master's link to it cut (`CLIENT KILL TYPE replica`: a stopped process still receives
    ///   into its socket buffer), so it misses every `INCR` from there on; at `at_unit` the
    ///   master is killed (`SIGKILL`) and the replica resumed, and the sentinels promote it
    ///   with counters that are behind. The issuer (through `redis+sentinel://`) follows the
    ///   new master; re-issued tokens meet Postgres, which rejects them (stale, or
    ///   [`DuplicateToken`](pgfence::Error::DuplicateToken)); the floor source and
    ///   `recover_from` restore liveness.
    ///
    /// Returns once the survivors named a new leader (or the sentinels promoted the replica),
    /// with what happened; `None` when the run ended before `at_unit` (nothing is recorded).
    /// Blocks a runtime thread briefly (`kill`, the leader look-ups), so it needs tokio's
    /// multi-thread runtime.
    ///
    /// # Errors
    /// [`ChaosError::Config`] when the deployment was not started for a failover;
    /// [`ChaosError::Failover`] when no leader is found before, or none elected within 60 s
    /// after; [`ChaosError::Server`] when a signal could not be sent.
    pub async fn failover_at(
        &mut self,
        ctl: &Control,
        at_unit: u64,
        replica_lag: u64,
    ) -> Result<Option<FailoverEvent>, ChaosError> {
        if !self.can_fail_over() {
            return Err(ChaosError::Config(
                "a failover needs the replicated deployment (Deployment::start(_, true))".into(),
            ));
        }
        let issuer = self.issuer();
        let event = match &mut self.0 {
            Servers::Sentinel(set) => redis_failover(set, ctl, at_unit, replica_lag).await?,
            Servers::Etcd(cluster) => {
                if !ctl.wait_for_units(at_unit).await {
                    return Ok(None);
                }
                let leader = |c: &EtcdCluster| c.leader();
                let old = wait_for_leader(&*cluster, leader, None).await?;
                let name = etcd_name(cluster, old);
                let killed = Instant::now();
                tokio::task::block_in_place(|| cluster.kill(old))?;
                let kill_ms = millis(killed.elapsed());
                ctl.mark_fault(FAILOVER);
                let new = wait_for_leader(&*cluster, leader, Some(old)).await?;
                Some(FailoverEvent {
                    issuer: issuer.name().to_owned(),
                    old_leader: name,
                    kill_ms,
                    new_leader: Some(etcd_name(cluster, new)),
                    new_leader_after_ms: Some(millis(killed.elapsed())),
                    replica_paused_at_unit: None,
                })
            }
            Servers::Zk(ensemble) => {
                if !ctl.wait_for_units(at_unit).await {
                    return Ok(None);
                }
                let leader = |z: &ZkEnsemble| z.leader();
                let old = wait_for_leader(&*ensemble, leader, None).await?;
                let name = zk_name(ensemble, old);
                let killed = Instant::now();
                tokio::task::block_in_place(|| ensemble.kill(old))?;
                let kill_ms = millis(killed.elapsed());
                ctl.mark_fault(FAILOVER);
                let new = wait_for_leader(&*ensemble, leader, Some(old)).await?;
                Some(FailoverEvent {
                    issuer: issuer.name().to_owned(),
                    old_leader: name,
                    kill_ms,
                    new_leader: Some(zk_name(ensemble, new)),
                    new_leader_after_ms: Some(millis(killed.elapsed())),
                    replica_paused_at_unit: None,
                })
            }
            Servers::Redis(_) => None,
        };
        if let Some(event) = &event {
            ctl.record_failover(event.clone());
        }
        Ok(event)
    }

    /// Stops every server and removes their directories (as dropping it does).
    pub fn stop(self) {
        drop(self);
    }
}

/// The Redis failover: pause and cut off the replica, kill the master, resume the replica,
/// wait for the sentinels to promote it.
async fn redis_failover(
    set: &mut SentinelSet,
    ctl: &Control,
    at_unit: u64,
    replica_lag: u64,
) -> Result<Option<FailoverEvent>, ChaosError> {
    if !ctl
        .wait_for_units(at_unit.saturating_sub(replica_lag))
        .await
    {
        return Ok(None);
    }
    let paused_at = ctl.units_started();
    set.replicas()[0].pause()?;
    let cut = tokio::task::block_in_place(|| set.master().command("CLIENT KILL TYPE replica"));
    if !cut.as_deref().is_some_and(|r| r.starts_with(":1")) {
        let _ = set.replicas()[0].resume();
        return Err(ChaosError::Failover(format!(
            "could not cut the replica's link (CLIENT KILL TYPE replica said {cut:?})"
        )));
    }
    if !ctl.wait_for_units(at_unit).await {
        set.replicas()[0].resume()?;
        return Ok(None);
    }
    let old = set.master().port();
    let killed = Instant::now();
    tokio::task::block_in_place(|| set.master_mut().kill())?;
    let kill_ms = millis(killed.elapsed());
    ctl.mark_fault(FAILOVER);
    set.replicas()[0].resume()?;
    let new = set
        .wait_for_new_master(old, ELECTION_TIMEOUT)
        .await
        .map_err(|e| ChaosError::Failover(e.to_string()))?;
    Ok(Some(FailoverEvent {
        issuer: IssuerKind::Redis.name().to_owned(),
        old_leader: format!("127.0.0.1:{old}"),
        kill_ms,
        new_leader: Some(format!("127.0.0.1:{new}")),
        new_leader_after_ms: Some(millis(killed.elapsed())),
        replica_paused_at_unit: Some(paused_at),
    }))
}

/// Polls `leader` until it names a member other than `not` (any member when `None`): 10 s
/// for the leader before the kill, [`ELECTION_TIMEOUT`] for the one after.
async fn wait_for_leader<T>(
    servers: &T,
    leader: impl Fn(&T) -> Option<usize>,
    not: Option<usize>,
) -> Result<usize, ChaosError> {
    let timeout = if not.is_some() {
        ELECTION_TIMEOUT
    } else {
        Duration::from_secs(10)
    };
    let deadline = Instant::now() + timeout;
    loop {
        let found = tokio::task::block_in_place(|| leader(servers));
        if let Some(i) = found.filter(|i| Some(*i) != not) {
            return Ok(i);
        }
        if Instant::now() > deadline {
            return Err(ChaosError::Failover(match not {
                Some(_) => format!("no new leader within {timeout:?} of the kill"),
                None => format!("no leader to kill within {timeout:?}"),
            }));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn etcd_name(cluster: &EtcdCluster, i: usize) -> String {
    let m = &cluster.members()[i];
    format!("{} (127.0.0.1:{})", m.name(), m.client_port())
}

fn zk_name(ensemble: &ZkEnsemble, i: usize) -> String {
    let m = &ensemble.members()[i];
    format!("{} ({})", m.name(), m.address())
}
