//! The ZooKeeper client calls the issuer makes: opening a session, one request with a
//! timeout, and the lock nodes' list, create and delete; which errors are transient.

use std::sync::Arc;
use std::time::Duration;

use zookeeper_client::{Acls, Client, CreateMode, SessionState, Stat};

use crate::{Error, Result};

/// How long connecting may take before [`ZkIssuer::connect`] gives up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long one request may wait for its reply (the client re-sends nothing by itself).
pub(super) const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// A ZooKeeper `NoNode`: the node is not there.
pub(super) fn is_no_node(e: &Error) -> bool {
    matches!(e.as_zk(), Some(zookeeper_client::Error::NoNode))
}

pub(super) fn ended(state: SessionState) -> bool {
    matches!(
        state,
        SessionState::Expired | SessionState::Closed | SessionState::AuthFailed
    )
}

pub(super) async fn open_session(hosts: &str, session_timeout: Duration) -> Result<Client> {
    let connect = Client::connector()
        .with_session_timeout(session_timeout)
        .connect(hosts);
    match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
        Ok(client) => Ok(client?),
        Err(_) => Err(Error::zookeeper(zookeeper_client::Error::Timeout)),
    }
}

/// One request with [`REQUEST_TIMEOUT`] (a timeout is [`zookeeper_client::Error::Timeout`]).
pub(super) async fn timed<T>(
    request: impl std::future::Future<Output = std::result::Result<T, zookeeper_client::Error>>,
) -> Result<T> {
    match tokio::time::timeout(REQUEST_TIMEOUT, request).await {
        Ok(reply) => Ok(reply?),
        Err(_) => Err(Error::zookeeper(zookeeper_client::Error::Timeout)),
    }
}

/// `dir`'s children and its stat; none when it does not exist.
pub(super) async fn list(client: &Client, dir: &str) -> Result<(Vec<String>, Option<Stat>)> {
    match timed(client.get_children(dir)).await {
        Ok((names, stat)) => Ok((names, Some(stat))),
        Err(e) if is_no_node(&e) => Ok((Vec::new(), None)),
        Err(e) => Err(e),
    }
}

/// Deletes a node; one that is already gone is fine.
pub(super) async fn delete(client: &Client, path: &str) -> Result<()> {
    match timed(client.delete(path, None)).await {
        Err(e) if !is_no_node(&e) => Err(e),
        Ok(()) | Err(_) => Ok(()),
    }
}

/// Creates `owner`'s ephemeral sequential node (`stem` + sequence) in `dir`, creating `dir`
/// (a container) and its parents first when missing.
pub(super) async fn create_lock_node(
    client: &Client,
    dir: &str,
    stem: &str,
    owner: &str,
) -> Result<Stat> {
    let node = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
    let container = CreateMode::Container.with_acls(Acls::anyone_all());
    let mut tries = 0;
    loop {
        match timed(client.create(stem, owner.as_bytes(), &node)).await {
            Ok((stat, _)) => return Ok(stat),
            // The container may be reaped between the mkdir and the create: try again.
            Err(e) if is_no_node(&e) && tries < 3 => {
                tries += 1;
                timed(client.mkdir(dir, &container)).await?;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Whether a ZooKeeper error is transient: the connection (including the I/O errors the client
/// reports as custom errors, such as a reset by a server that died), a timeout, throttling, or
/// a session that ended (the next call opens a new one).
pub(crate) fn is_transient(e: &zookeeper_client::Error) -> bool {
    use zookeeper_client::Error as Zk;
    match e {
        Zk::ConnectionLoss
        | Zk::Timeout
        | Zk::NoHosts
        | Zk::Throttled
        | Zk::SessionMoved
        | Zk::SessionExpired
        | Zk::ClientClosed => true,
        Zk::Custom(custom) => {
            let mut source: Option<&(dyn std::error::Error + 'static)> = Some(custom);
            while let Some(err) = source {
                // The client keeps its sources as `Arc<dyn Error>`: look inside the `Arc`.
                let shared = err
                    .downcast_ref::<Arc<dyn std::error::Error + Send + Sync>>()
                    .is_some_and(|inner| inner.is::<std::io::Error>());
                if shared || err.is::<std::io::Error>() {
                    return true;
                }
                source = err.source();
            }
            false
        }
        _ => false,
    }
}

impl From<zookeeper_client::Error> for Error {
    fn from(e: zookeeper_client::Error) -> Self {
        Error::zookeeper(e)
    }
}
