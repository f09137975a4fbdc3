//! What sections `etcd` and `zk` share: the server of the run (a throwaway local server kept
//! for every round, or one named by a URL in the environment) with its CPU per operation read
//! from `/proc/<pid>/stat`, and the measurement that records it (features `etcd` / `zk`
//! only); and what they share with section `pg` too: [`CycleIssuer`] for each issuer, the
//! acquire-only load that keeps its leases, and the unmeasured release of those leases.

use std::future::Future;
use std::sync::{Arc, Mutex};

#[cfg(any(feature = "etcd", feature = "zk"))]
use anyhow::{Context, Result};
use pgfence::{Lease, Resource};
#[cfg(any(feature = "etcd", feature = "zk"))]
use pgfence_testkit::ServerError;

use crate::LEASE_TTL;
#[cfg(any(feature = "etcd", feature = "zk"))]
use crate::measure::{Metric, Sample, measure};
use crate::measure::{Outcome, Workload};
#[cfg(any(feature = "etcd", feature = "zk"))]
use crate::servers::Env;
use crate::workloads::CycleIssuer;

/// A throwaway server a section can start, and what tells it apart.
#[cfg(any(feature = "etcd", feature = "zk"))]
pub(crate) trait LocalServer: Sized + Send + Sync + 'static {
    /// The environment variable naming a server to use instead (`PGFENCE_ETCD_URL`...).
    const ENV: &'static str;
    /// The server's name, for the error when it does not start.
    const NAME: &'static str;
    /// What the throwaway server is, for the progress output.
    const WHAT: &'static str;

    /// Starts a throwaway server.
    fn start() -> impl Future<Output = std::result::Result<Self, ServerError>>;

    /// Its URL, for the issuer.
    fn url(&self) -> String;

    /// The process whose CPU is accounted to the server.
    fn pid(&self) -> Option<u32>;

    /// Where a sample records the server's CPU per operation.
    fn server_us_per_op(sample: &mut Sample) -> &mut Option<f64>;
}

/// The server of a section's run: a throwaway server (kept for every round), or the one
/// [`LocalServer::ENV`] names.
#[cfg(any(feature = "etcd", feature = "zk"))]
pub(crate) struct Server<S> {
    /// Kept alive for the run; `None` for [`LocalServer::ENV`].
    local: Option<S>,
    url: String,
}

/// Microseconds per `USER_HZ` tick.
#[cfg(any(feature = "etcd", feature = "zk"))]
const TICK_US: f64 = 10_000.0;

#[cfg(any(feature = "etcd", feature = "zk"))]
impl<S: LocalServer> Server<S> {
    /// [`LocalServer::ENV`], or a throwaway server.
    pub(crate) async fn start() -> Result<Self> {
        if let Some(url) = std::env::var(S::ENV).ok().filter(|u| !u.trim().is_empty()) {
            return Ok(Self { local: None, url });
        }
        let local = S::start()
            .await
            .with_context(|| format!("starting a throwaway {} (or set {})", S::NAME, S::ENV))?;
        let url = local.url();
        Ok(Self {
            local: Some(local),
            url,
        })
    }

    /// Where it came from, for the progress output.
    pub(crate) fn describe(&self) -> String {
        match &self.local {
            Some(_) => format!("{} at {}", S::WHAT, self.url),
            None => format!("{} {}", S::ENV, self.url),
        }
    }

    /// The server's URL.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// The server's CPU ticks (user + system, all threads) so far, for a local throwaway
    /// server.
    fn ticks(&self) -> Option<u64> {
        let pid = self.local.as_ref()?.pid()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        pgfence_bench::parse_proc_stat(&stat).map(|(_, own, _)| own)
    }

    /// Runs `work` like [`measure`], and also reads the server's CPU per operation.
    pub(crate) async fn measure<W: Workload>(&self, env: &Env, work: W) -> Result<Sample> {
        let before = self.ticks();
        let mut sample = measure(&env.cfg, env.cfg.tasks, Metric::Applied, work).await?;
        let after = self.ticks();
        if let (Some(a), Some(b)) = (before, after)
            && sample.total_ops > 0
        {
            *S::server_us_per_op(&mut sample) =
                Some(b.saturating_sub(a) as f64 * TICK_US / sample.total_ops as f64);
        }
        Ok(sample)
    }
}

/// [`CycleIssuer`] through the issuer's own `acquire` and `release`.
macro_rules! cycle_issuer {
    ($ty:ty) => {
        impl CycleIssuer for $ty {
            fn acquire(
                &self,
                resource: &Resource,
                ttl: std::time::Duration,
            ) -> impl Future<Output = pgfence::Result<Option<Lease>>> + Send {
                <$ty>::acquire(self, resource, ttl)
            }

            fn release(
                &self,
                lease: &Lease,
            ) -> impl Future<Output = pgfence::Result<pgfence::issuer::ReleaseOutcome>> + Send {
                <$ty>::release(self, lease)
            }
        }
    };
}

#[cfg(feature = "etcd")]
cycle_issuer!(pgfence::issuer::EtcdIssuer);
#[cfg(feature = "zk")]
cycle_issuer!(pgfence::issuer::ZkIssuer);
cycle_issuer!(pgfence::issuer::PgIssuer);

/// Acquire of a fresh resource each time; the leases are kept for a release after the
/// measurement.
pub(crate) struct AcquireHeld<I> {
    pub(crate) issuer: I,
    pub(crate) prefix: String,
    pub(crate) held: Arc<Mutex<Vec<Lease>>>,
}

impl<I: CycleIssuer> Workload for AcquireHeld<I> {
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

/// Runs `release` on every lease `held` took, on `tasks` tasks (unmeasured; errors are the
/// caller's to ignore: the leases expire anyway).
pub(crate) async fn release_held<F, Fut>(held: &Mutex<Vec<Lease>>, tasks: usize, release: F)
where
    F: Fn(Lease) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let leases = std::mem::take(&mut *held.lock().expect("not poisoned"));
    let leases = Arc::new(Mutex::new(leases));
    let handles: Vec<_> = (0..tasks.max(1))
        .map(|_| {
            let (release, leases) = (release.clone(), Arc::clone(&leases));
            tokio::spawn(async move {
                loop {
                    let next = leases.lock().expect("not poisoned").pop();
                    let Some(lease) = next else { break };
                    release(lease).await;
                }
            })
        })
        .collect();
    for h in handles {
        let _ = h.await;
    }
}
