//! Throwaway etcd servers: one node, or a cluster of members on 127.0.0.1, started from the
//! installed `etcd` binary, each member killable (`SIGKILL`, by PID) and restartable in place.
//!
//! Every member runs under a small `sh` supervisor that owns a fresh temporary directory
//! (under `/dev/shm` when it is writable, so etcd's fsyncs cost nothing; else `$TMPDIR` or
//! `/tmp`) and starts etcd when told to on its stdin. When the pipe closes — this process
//! dropped the cluster, exited, panicked or was killed — the supervisor kills etcd and removes
//! the directory, like the other throwaway servers of this crate.
//!
//! Members use a short heartbeat (50 ms) and election timeout (500 ms), so a killed leader is
//! replaced within about a second; the smallest lease TTL they grant is then 1 s.
//!
//! [`EtcdCluster::start_tls`] starts members whose client port speaks TLS only and requires a
//! client certificate of a [`Certs`] CA (`--client-cert-auth`); peer traffic stays plain, and
//! health checks go to a plain metrics port.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::optional::{Etcd, Installed};
use crate::process::{self, Member, Supervisor};
use crate::{Certs, ServerError, find_in_path, sh_quote};

/// The server's name in errors.
const WHAT: &str = "etcd";

const ETCD_HINT: &str = "install etcd (Debian: apt-get install etcd-server), or set \
    PGFENCE_ETCD_BIN to the etcd binary";

/// Heartbeat interval of throwaway members, in milliseconds.
pub const ETCD_HEARTBEAT_MS: u64 = 50;
/// Election timeout of throwaway members, in milliseconds.
pub const ETCD_ELECTION_MS: u64 = 500;

/// The `etcd` binary: `PGFENCE_ETCD_BIN`, or `etcd` on `PATH` (none when
/// [`crate::optional::HIDE_ENV`] hides `etcd`).
pub(crate) fn etcd_bin() -> Result<PathBuf, ServerError> {
    let found = match std::env::var_os("PGFENCE_ETCD_BIN") {
        Some(_) if crate::optional::hidden("etcd") => None,
        Some(bin) => Some(PathBuf::from(bin)).filter(|p| p.is_file()),
        None => find_in_path("etcd"),
    };
    found.ok_or(ServerError::NotInstalled {
        what: "etcd",
        hint: ETCD_HINT,
    })
}

/// One member of an [`EtcdCluster`].
#[derive(Debug)]
pub struct EtcdMember {
    process: Member,
    peer_port: u16,
    /// Where `/health` answers in plain HTTP: the client port, or the metrics port of a TLS
    /// member.
    health_port: u16,
    /// The client port speaks TLS only.
    tls: bool,
}

impl EtcdMember {
    /// The member's name (`m0`, `m1`, ...).
    #[must_use]
    pub fn name(&self) -> &str {
        &self.process.name
    }

    /// Client port on 127.0.0.1.
    #[must_use]
    pub fn client_port(&self) -> u16 {
        self.process.client_port
    }

    /// Peer (Raft) port on 127.0.0.1.
    #[must_use]
    pub fn peer_port(&self) -> u16 {
        self.peer_port
    }

    /// `http://127.0.0.1:PORT` (`https://` for a TLS member), the member's client endpoint.
    #[must_use]
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.process.client_port)
    }

    /// Whether the client port speaks TLS only ([`EtcdCluster::start_tls`]).
    #[must_use]
    pub fn is_tls(&self) -> bool {
        self.tls
    }

    /// The member's temporary directory (removed when it stops).
    #[must_use]
    pub fn dir(&self) -> &Path {
        self.process.supervisor.dir()
    }

    /// Whether the member was started and not killed since.
    #[must_use]
    pub fn is_running(&self) -> bool {
        self.process.running
    }

    /// The etcd process id, while it runs.
    #[must_use]
    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    #[allow(clippy::too_many_arguments, reason = "one private constructor")]
    fn spawn(
        bin: &Path,
        base: &Path,
        name: String,
        client_port: u16,
        peer_port: u16,
        initial_cluster: &str,
        cluster_token: &str,
        tls: Option<&TlsSetup>,
    ) -> Result<Self, ServerError> {
        let (scheme, tls_args, health_port) = match tls {
            None => ("http", String::new(), client_port),
            Some(t) => (
                "https",
                format!(
                    "--client-cert-auth --trusted-ca-file {ca} --cert-file {cert} \
                     --key-file {key} --listen-metrics-urls http://127.0.0.1:{metrics} ",
                    ca = sh_quote(&t.ca),
                    cert = sh_quote(&t.cert),
                    key = sh_quote(&t.key),
                    metrics = t.metrics_port,
                ),
                t.metrics_port,
            ),
        };
        let etcd = format!(
            "{bin} --name {name} --data-dir \"$dir/data\" \
             --listen-client-urls {scheme}://127.0.0.1:{client_port} \
             --advertise-client-urls {scheme}://127.0.0.1:{client_port} {tls_args}\
             --listen-peer-urls http://127.0.0.1:{peer_port} \
             --initial-advertise-peer-urls http://127.0.0.1:{peer_port} \
             --initial-cluster {initial_cluster} --initial-cluster-state new \
             --initial-cluster-token {cluster_token} \
             --heartbeat-interval {ETCD_HEARTBEAT_MS} --election-timeout {ETCD_ELECTION_MS} \
             --logger zap --log-outputs stderr --log-level warn",
            bin = sh_quote(bin),
        );
        let supervisor = Supervisor::member(
            WHAT,
            &format!("{}/pgfence-etcd.XXXXXX", sh_quote(base)),
            &etcd,
        )?;
        Ok(Self {
            process: Member::new(name, client_port, 20, supervisor),
            peer_port,
            health_port,
            tls: tls.is_some(),
        })
    }

    /// The last lines of the member's log, for error messages.
    #[must_use]
    pub fn log_tail(&self) -> String {
        self.process.log_tail()
    }

    /// Whether the member answers `/health` with `"health":"true"` (it has a leader).
    #[must_use]
    pub fn healthy(&self) -> bool {
        health(self.health_port)
    }

    /// The member's view of the cluster (the v3 gateway's `/v3/maintenance/status`): its own
    /// member id and the leader's, or `None` when it does not answer (always for a TLS
    /// member: the gateway is on its TLS client port).
    #[must_use]
    pub fn status(&self) -> Option<(u64, u64)> {
        if self.tls {
            return None;
        }
        let body = http(
            self.process.client_port,
            "POST",
            "/v3/maintenance/status",
            "{}",
        )?;
        let member = json_u64(&body, "member_id")?;
        let leader = json_u64(&body, "leader")?;
        Some((member, leader))
    }
}

/// A throwaway etcd cluster on 127.0.0.1 (one member for a single node). Dropping it stops
/// every member and removes their directories.
#[derive(Debug)]
pub struct EtcdCluster {
    members: Vec<EtcdMember>,
}

/// The certificates of a TLS member, and its plain metrics port.
#[derive(Clone, Debug)]
struct TlsSetup {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
    metrics_port: u16,
}

impl EtcdCluster {
    /// Starts a single-node etcd.
    ///
    /// # Errors
    /// As [`EtcdCluster::start`].
    pub async fn single(etcd: Installed<Etcd>) -> Result<Self, ServerError> {
        Self::start(etcd, 1).await
    }

    /// Starts `size` members (1 for a single node; 3 for a cluster that survives losing one)
    /// on free ports and waits until every member reports a leader (`/health`).
    ///
    /// # Errors
    /// [`ServerError::NotInstalled`] when no `etcd` binary is found;
    /// [`ServerError::StartFailed`] when the cluster does not form within 30 s (after three
    /// tries with fresh ports).
    pub async fn start(_etcd: Installed<Etcd>, size: usize) -> Result<Self, ServerError> {
        assert!(size >= 1, "an etcd cluster has at least one member");
        let bin = etcd_bin()?;
        process::retry(3, || Self::try_start(&bin, size, None)).await
    }

    /// Like [`EtcdCluster::start`], with client ports that speak TLS only (the server
    /// certificate of `certs`) and require a client certificate signed by its CA
    /// (`--client-cert-auth`). Peer traffic stays plain. [`EtcdCluster::url`] is then
    /// `etcd+https://...` (add `?cacert=...&cert=...&key=...` to connect).
    ///
    /// # Errors
    /// As [`EtcdCluster::start`].
    pub async fn start_tls(
        _etcd: Installed<Etcd>,
        size: usize,
        certs: &Certs,
    ) -> Result<Self, ServerError> {
        assert!(size >= 1, "an etcd cluster has at least one member");
        let bin = etcd_bin()?;
        let (ca, cert, key) = (certs.ca(), certs.server_cert(), certs.server_key());
        process::retry(3, || {
            let tls = (ca.clone(), cert.clone(), key.clone());
            Self::try_start(&bin, size, Some(tls))
        })
        .await
    }

    async fn try_start(
        bin: &Path,
        size: usize,
        tls: Option<(PathBuf, PathBuf, PathBuf)>,
    ) -> Result<Self, ServerError> {
        let per_member = if tls.is_some() { 3 } else { 2 };
        let ports = process::free_ports(size * per_member)?;
        let base = process::scratch_base();
        let names: Vec<String> = (0..size).map(|i| format!("m{i}")).collect();
        let initial_cluster = names
            .iter()
            .zip(ports.chunks(per_member))
            .map(|(name, p)| format!("{name}=http://127.0.0.1:{}", p[1]))
            .collect::<Vec<_>>()
            .join(",");
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let token = format!("pgfence-{}-{nanos}-{}", std::process::id(), ports[0]);
        let mut members = Vec::with_capacity(size);
        for (name, p) in names.into_iter().zip(ports.chunks(per_member)) {
            let (bin, base, ic, token) = (
                bin.to_owned(),
                base.clone(),
                initial_cluster.clone(),
                token.clone(),
            );
            let (client, peer) = (p[0], p[1]);
            let setup = tls.as_ref().map(|(ca, cert, key)| TlsSetup {
                ca: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
                metrics_port: p[2],
            });
            let member = process::blocking(move || {
                EtcdMember::spawn(&bin, &base, name, client, peer, &ic, &token, setup.as_ref())
            })
            .await?;
            members.push(member);
        }
        let mut cluster = Self { members };
        for member in &mut cluster.members {
            member.process.start()?;
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        for i in 0..size {
            cluster.wait_healthy(i, deadline).await?;
        }
        Ok(cluster)
    }

    async fn wait_healthy(&mut self, i: usize, deadline: Instant) -> Result<(), ServerError> {
        let member = &mut self.members[i];
        if !member.tls {
            return member.process.wait_ready("healthy", deadline, health).await;
        }
        // `/health` is on the plain metrics port, not the (TLS) client port.
        let port = member.health_port;
        let process = &mut member.process;
        let exited = || match process.pid() {
            Some(pid) if !process::process_alive(pid) => Err(ServerError::StartFailed {
                what: WHAT,
                detail: format!("member {} exited: {}", process.name, process.log_tail()),
            }),
            _ => Ok(()),
        };
        if process::poll_until(deadline, exited, move || health(port)).await? {
            return Ok(());
        }
        Err(ServerError::StartFailed {
            what: WHAT,
            detail: format!(
                "member {} not healthy in time: {}",
                member.process.name,
                member.process.log_tail()
            ),
        })
    }

    /// The members, in start order.
    #[must_use]
    pub fn members(&self) -> &[EtcdMember] {
        &self.members
    }

    /// Every member's client endpoint (`http://127.0.0.1:PORT`, `https://` with TLS).
    #[must_use]
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(EtcdMember::endpoint).collect()
    }

    /// `etcd://127.0.0.1:P1,127.0.0.1:P2,...`, the URL that selects pgfence's etcd issuer
    /// (`etcd+https://...` for [`EtcdCluster::start_tls`]).
    #[must_use]
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.process.client_port))
            .collect();
        let scheme = if self.members.iter().any(|m| m.tls) {
            "etcd+https"
        } else {
            "etcd"
        };
        format!("{scheme}://{}", hosts.join(","))
    }

    /// The index of the member every running member names as leader, if they agree.
    #[must_use]
    pub fn leader(&self) -> Option<usize> {
        let views: Vec<(usize, u64, u64)> = self
            .members
            .iter()
            .enumerate()
            .filter(|(_, m)| m.process.running)
            .filter_map(|(i, m)| m.status().map(|(id, leader)| (i, id, leader)))
            .collect();
        let leader = views.first()?.2;
        if leader == 0 || views.iter().any(|v| v.2 != leader) {
            return None;
        }
        views.iter().find(|v| v.1 == leader).map(|v| v.0)
    }

    /// Kills member `i` with `SIGKILL` (its PID only) and waits until it has exited and its
    /// client port is closed. Its data directory stays, for [`EtcdCluster::restart`].
    ///
    /// # Errors
    /// The member is not running, or `kill` failed.
    pub fn kill(&mut self, i: usize) -> Result<(), ServerError> {
        self.members[i].process.kill()
    }

    /// Starts killed member `i` again on its data directory and waits until it is healthy.
    ///
    /// # Errors
    /// [`ServerError::StartFailed`] when it does not rejoin within 30 s.
    pub async fn restart(&mut self, i: usize) -> Result<(), ServerError> {
        if self.members[i].process.running {
            self.kill(i)?;
        }
        self.members[i].process.start()?;
        self.wait_healthy(i, Instant::now() + Duration::from_secs(30))
            .await
    }
}

/// Whether the member on `port` answers `/health` with `"health":"true"` (it has a leader).
fn health(port: u16) -> bool {
    http(port, "GET", "/health", "").is_some_and(|body| body.contains("\"health\":\"true\""))
}

/// A tiny HTTP/1.1 client for etcd's `/health` and gateway endpoints. `None` on any failure.
fn http(port: u16, method: &str, path: &str, body: &str) -> Option<String> {
    let mut stream = TcpStream::connect_timeout(
        &SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
        Duration::from_millis(500),
    )
    .ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    stream
        .set_write_timeout(Some(Duration::from_secs(2)))
        .ok()?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_owned())
}

/// The number in `"key":"123"` or `"key":123` (the gateway writes 64-bit integers as strings).
fn json_u64(body: &str, key: &str) -> Option<u64> {
    let at = body.find(&format!("\"{key}\":"))? + key.len() + 3;
    let digits: String = body[at..]
        .trim_start_matches('"')
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::json_u64;

    #[test]
    fn reads_gateway_numbers() {
        let body =
            r#"{"header":{"cluster_id":"1","member_id":"42","revision":"7"},"leader":"42","x":9}"#;
        assert_eq!(json_u64(body, "member_id"), Some(42));
        assert_eq!(json_u64(body, "leader"), Some(42));
        assert_eq!(json_u64(body, "x"), Some(9));
        assert_eq!(json_u64(body, "nope"), None);
    }
}
