//! The optional servers — Redis Sentinel, etcd, ZooKeeper, PgBouncer, Patroni — and the one way
//! a test gets to start one: [`needs`], which either hands back an [`Installed`] proof or
//! prints the test's one skip line (naming the Debian package to install) and returns `None`.
//!
//! The start functions of these servers ([`crate::SentinelSet::start`],
//! [`crate::SentinelTls::start`], [`crate::EtcdCluster::start`], [`crate::ZkEnsemble::start`],
//! [`crate::PgBouncer::start`], [`crate::PatroniCluster::start`], …) take that proof, so a
//! test that did not ask cannot start one: it does not compile. Programs (the race harness,
//! the benchmark) ask with [`installed`] instead and report the missing package as an error;
//! the workspace's source rules (`crates/testkit/tests/skip_rule.rs`) keep tests off it.
//!
//! `PGFENCE_TESTKIT_HIDE=redis-sentinel,etcd,zookeeper,pgbouncer,patroni` makes the testkit
//! treat the named binaries as absent (a comma-separated list of binary names; `zookeeper`
//! stands for its jar), in this process and in the processes it starts with its environment:
//! `.ci/run` runs the tests that use optional servers that way, to prove that they skip on a
//! machine without them.

use std::marker::PhantomData;

use crate::ServerError;

/// The environment variable naming the binaries the testkit treats as not installed.
pub const HIDE_ENV: &str = "PGFENCE_TESTKIT_HIDE";

/// Whether `binary` is named in [`HIDE_ENV`].
#[must_use]
pub fn hidden(binary: &str) -> bool {
    std::env::var(HIDE_ENV).is_ok_and(|list| list.split(',').any(|name| name.trim() == binary))
}

mod sealed {
    pub trait Sealed {}
}

/// An optional server: what it is, which Debian packages bring it, and whether it is here.
pub trait OptionalServer: sealed::Sealed {
    /// What the skip line and the error name.
    const WHAT: &'static str;
    /// The Debian packages to install (`apt-get install ...`).
    const PACKAGES: &'static str;
    /// `Ok` when the server can be started here; the missing piece otherwise.
    ///
    /// # Errors
    /// [`ServerError::NotInstalled`] naming what is missing.
    fn probe() -> Result<(), ServerError>;
}

/// Redis Sentinel: `redis-server` and `redis-sentinel` (plaintext or TLS deployments).
#[derive(Debug)]
pub struct Sentinel;
/// The etcd server (`etcd`, or `PGFENCE_ETCD_BIN`).
#[derive(Debug)]
pub struct Etcd;
/// ZooKeeper: `java` and the ZooKeeper jar (or `PGFENCE_ZK_CLASSPATH`).
#[derive(Debug)]
pub struct ZooKeeper;
/// Debian's PgBouncer.
#[derive(Debug)]
pub struct PgBouncer;
/// Patroni with its etcd client module, the etcd server and the PostgreSQL server.
#[derive(Debug)]
pub struct Patroni;

impl sealed::Sealed for Sentinel {}
impl sealed::Sealed for Etcd {}
impl sealed::Sealed for ZooKeeper {}
impl sealed::Sealed for PgBouncer {}
impl sealed::Sealed for Patroni {}

impl OptionalServer for Sentinel {
    const WHAT: &'static str = "Redis Sentinel (redis-sentinel)";
    const PACKAGES: &'static str = "redis-sentinel";
    fn probe() -> Result<(), ServerError> {
        crate::sentinel::sentinel_bins().map(|_| ())
    }
}

impl OptionalServer for Etcd {
    const WHAT: &'static str = "etcd";
    const PACKAGES: &'static str = "etcd-server";
    fn probe() -> Result<(), ServerError> {
        crate::etcd::etcd_bin().map(|_| ())
    }
}

impl OptionalServer for ZooKeeper {
    const WHAT: &'static str = "ZooKeeper";
    const PACKAGES: &'static str = "zookeeper";
    fn probe() -> Result<(), ServerError> {
        crate::zk::zk_launch().map(|_| ())
    }
}

impl OptionalServer for PgBouncer {
    const WHAT: &'static str = "PgBouncer";
    const PACKAGES: &'static str = "pgbouncer";
    fn probe() -> Result<(), ServerError> {
        crate::pgbouncer::pgbouncer_bin().map(|_| ())
    }
}

impl OptionalServer for Patroni {
    const WHAT: &'static str = "Patroni (with python3-etcd and etcd)";
    const PACKAGES: &'static str = "patroni python3-etcd etcd-server";
    fn probe() -> Result<(), ServerError> {
        crate::patroni::patroni_bin()?;
        crate::etcd::etcd_bin()?;
        crate::postgres_bindir().map(|_| ())
    }
}

/// Proof that the optional server `S` was found: what its start functions take.
///
/// Made only by [`needs`] (tests) and [`installed`] (programs); nothing outside the testkit can
/// make one otherwise:
///
/// ```compile_fail,E0451
/// let etcd: pgfence_testkit::Installed<pgfence_testkit::optional::Etcd> =
///     pgfence_testkit::Installed { _server: std::marker::PhantomData };
/// ```
pub struct Installed<S> {
    _server: PhantomData<fn() -> S>,
}

impl<S> Clone for Installed<S> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<S> Copy for Installed<S> {}

impl<S: OptionalServer> std::fmt::Debug for Installed<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Installed<{}>", S::WHAT)
    }
}

impl<S> Installed<S> {
    /// Inside the testkit: an optional server that starts another (Patroni's etcd).
    pub(crate) fn assume() -> Self {
        Self {
            _server: PhantomData,
        }
    }
}

/// The skip line of `test` when `S` is missing (`missing`: what its probe said): one format
/// for every test, naming the Debian packages to install.
#[must_use]
pub fn skip_line<S: OptionalServer>(test: &str, missing: &ServerError) -> String {
    let found = match missing {
        ServerError::NotInstalled { what, .. } => format!("{what} not found"),
        other => other.to_string(),
    };
    let hide = std::env::var(HIDE_ENV)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .map(|v| format!("; {HIDE_ENV}={v}"))
        .unwrap_or_default();
    format!(
        "SKIPPED {test}: {} is not installed (Debian: apt-get install {}; {found}{hide})",
        S::WHAT,
        S::PACKAGES
    )
}

/// The one skip mechanism of the tests: `Some` proof that `S` is installed, or `None` after
/// printing `test`'s skip line (what is missing and the Debian package that brings it). A
/// test that gets `None` returns (and passes):
///
/// ```no_run
/// use pgfence_testkit::{EtcdCluster, optional};
/// # async fn leader_failover() {
/// let Some(etcd) = optional::needs::<optional::Etcd>("leader_failover") else {
///     return;
/// };
/// let cluster = EtcdCluster::start(etcd, 3).await.unwrap();
/// # }
/// ```
#[must_use]
pub fn needs<S: OptionalServer>(test: &str) -> Option<Installed<S>> {
    match installed::<S>() {
        Ok(proof) => Some(proof),
        Err(missing) => {
            eprintln!("{}", skip_line::<S>(test, &missing));
            None
        }
    }
}

/// For programs, not tests (a test goes through [`needs`]): the proof that `S` is installed.
///
/// # Errors
/// [`ServerError::NotInstalled`] naming what is missing and what to install.
pub fn installed<S: OptionalServer>() -> Result<Installed<S>, ServerError> {
    S::probe().map(|()| Installed::assume())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_skip_line_names_the_test_the_server_and_the_package() {
        let missing = ServerError::NotInstalled {
            what: "java (for ZooKeeper)",
            hint: "install ZooKeeper",
        };
        let line = skip_line::<ZooKeeper>("leader_failover", &missing);
        assert!(
            line.starts_with(
                "SKIPPED leader_failover: ZooKeeper is not installed (Debian: apt-get install \
                 zookeeper; java (for ZooKeeper) not found"
            ),
            "{line}"
        );
        assert_eq!(line.lines().count(), 1, "{line}");
        let line = skip_line::<Patroni>("t", &missing);
        assert!(
            line.contains("apt-get install patroni python3-etcd etcd-server;"),
            "{line}"
        );
    }
}
