//! Why a run could not be set up or verified.

use pgfence::Error;

/// Why a run could not be set up or verified. Errors the workers meet during the run are not
/// this: they are data, recorded in the [`Report`](crate::Report).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChaosError {
    /// The configuration is inconsistent.
    #[error("invalid harness configuration: {0}")]
    Config(String),
    /// Postgres or the issuer failed during setup or verification.
    #[error(transparent)]
    Fence(#[from] Error),
    /// A throwaway server (or issuer deployment) could not be started, restarted or killed.
    #[error("throwaway server: {0}")]
    Server(#[from] pgfence_testkit::ServerError),
    /// An issuer failover did not go as planned (no leader to kill, none elected after).
    #[error("failover: {0}")]
    Failover(String),
    /// A worker task panicked or was cancelled; the run's history is incomplete.
    #[error("a worker task failed: {0}")]
    Worker(String),
    /// [`ReseedCounter::install_global`](crate::ReseedCounter::install_global) found another
    /// global `tracing` subscriber already installed.
    #[error("cannot install the reseed counter: {0}")]
    Subscriber(String),
}

impl From<sqlx::Error> for ChaosError {
    fn from(e: sqlx::Error) -> Self {
        ChaosError::Fence(e.into())
    }
}

impl From<redis::RedisError> for ChaosError {
    fn from(e: redis::RedisError) -> Self {
        ChaosError::Fence(e.into())
    }
}
