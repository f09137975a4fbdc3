//! Throwaway Apache ZooKeeper servers: one standalone server, or an ensemble of members on
//! 127.0.0.1, started from the installed ZooKeeper jar (Debian's `zookeeper` package), each
//! member killable (`SIGKILL`), pausable (`SIGSTOP` / `SIGCONT`) by its own PID and
//! restartable in place.
//!
//! Every member runs under a small `sh` supervisor that owns a fresh temporary directory
//! (under `/dev/shm` when it is writable, so ZooKeeper's transaction log costs nothing; else
//! `$TMPDIR` or `/tmp`) and starts the JVM when told to on its stdin. When the pipe closes —
//! this process dropped the ensemble, exited, panicked or was killed — the supervisor kills
//! the JVM (a stopped one too) and removes the directory, like the other throwaway servers of
//! this crate.
//!
//! Members tick every [`ZK_TICK_MS`] (200 ms) with `syncLimit` 10 ticks. A killed leader's
//! followers see their connections reset and elect a new leader in about 0.4 s; a paused
//! (`SIGSTOP`) leader is noticed only after `syncLimit` ticks, so it is replaced in about
//! 2.3 s. Sessions may last from [`ZK_MIN_SESSION_TIMEOUT_MS`] to
//! [`ZK_MAX_SESSION_TIMEOUT_MS`].

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::optional::{Installed, ZooKeeper};
use crate::process::{self, Member, Supervisor};
use crate::{ServerError, find_in_path, sh_quote};

/// The server's name in errors.
const WHAT: &str = "zookeeper";

const ZK_HINT: &str = "install ZooKeeper (Debian: apt-get install zookeeper, which brings a Java \
    runtime), or set PGFENCE_ZK_CLASSPATH to ZooKeeper's classpath (with `java` on PATH)";

/// Where Debian's `libzookeeper-java` puts the server jar (its manifest names its dependencies).
const ZK_JAR: &str = "/usr/share/java/zookeeper.jar";
/// An SLF4J binding that logs to stderr, so the member's log says something (Debian's jar
/// brings only `slf4j-api`, which logs nothing).
const SLF4J_SIMPLE_JAR: &str = "/usr/share/java/slf4j-simple.jar";

/// `tickTime` of throwaway members, in milliseconds.
pub const ZK_TICK_MS: u64 = 200;
/// `minSessionTimeout` of throwaway members (two ticks), in milliseconds.
pub const ZK_MIN_SESSION_TIMEOUT_MS: u64 = 2 * ZK_TICK_MS;
/// `maxSessionTimeout` of throwaway members, in milliseconds.
pub const ZK_MAX_SESSION_TIMEOUT_MS: u64 = 60_000;

/// How long [`ZkEnsemble::start`] (per try) and [`ZkEnsemble::restart`] wait for members to
/// serve: JVMs start slowly on a busy machine.
const SERVE_TIMEOUT: Duration = Duration::from_secs(60);

/// The `java` binary and the classpath to start ZooKeeper with.
pub(crate) fn zk_launch() -> Result<(PathBuf, String), ServerError> {
    if crate::optional::hidden("zookeeper") {
        return Err(ServerError::NotInstalled {
            what: "zookeeper",
            hint: ZK_HINT,
        });
    }
    let java = find_in_path("java").ok_or(ServerError::NotInstalled {
        what: "java (for ZooKeeper)",
        hint: ZK_HINT,
    })?;
    if let Some(classpath) = std::env::var("PGFENCE_ZK_CLASSPATH")
        .ok()
        .filter(|c| !c.is_empty())
    {
        return Ok((java, classpath));
    }
    if !Path::new(ZK_JAR).is_file() {
        return Err(ServerError::NotInstalled {
            what: "zookeeper",
            hint: ZK_HINT,
        });
    }
    let mut classpath = ZK_JAR.to_owned();
    if Path::new(SLF4J_SIMPLE_JAR).is_file() {
        classpath.push(':');
        classpath.push_str(SLF4J_SIMPLE_JAR);
    }
    Ok((java, classpath))
}

/// One member of a [`ZkEnsemble`].
#[derive(Debug)]
pub struct ZkMember {
    process: Member,
    id: u32,
    peer_port: u16,
    election_port: u16,
    paused: bool,
}

impl ZkMember {
    /// The member's name (`m0`, `m1`, ...).
    #[must_use]
    pub fn name(&self) -> &str {
        &self.process.name
    }

    /// The member's server id (`myid`: 1, 2, ...; `m0` is 1).
    #[must_use]
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Client port on 127.0.0.1.
    #[must_use]
    pub fn client_port(&self) -> u16 {
        self.process.client_port
    }

    /// Quorum (follower-to-leader) port on 127.0.0.1; unused by a standalone server.
    #[must_use]
    pub fn peer_port(&self) -> u16 {
        self.peer_port
    }

    /// Leader-election port on 127.0.0.1; unused by a standalone server.
    #[must_use]
    pub fn election_port(&self) -> u16 {
        self.election_port
    }

    /// `127.0.0.1:PORT`, the member's client address.
    #[must_use]
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.process.client_port)
    }

    /// The member's temporary directory (removed when it stops): `zoo.cfg`, `server.log`, and
    /// the data directory `data`.
    #[must_use]
    pub fn dir(&self) -> &Path {
        self.process.supervisor.dir()
    }

    /// Whether the member runs: started, not killed since, and not paused.
    #[must_use]
    pub fn is_running(&self) -> bool {
        self.process.running && !self.paused
    }

    /// Whether the member is paused ([`ZkEnsemble::pause`]).
    #[must_use]
    pub fn is_paused(&self) -> bool {
        self.process.running && self.paused
    }

    /// The JVM's process id, while it runs (paused or not).
    #[must_use]
    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    /// The member's role from the `srvr` four-letter command: `leader`, `follower` or
    /// `standalone`. `None` when it does not answer within about a second, or answers that it
    /// is not serving (no quorum, or still electing).
    #[must_use]
    pub fn mode(&self) -> Option<String> {
        let reply = four_letter(self.process.client_port, "srvr")?;
        reply
            .lines()
            .find_map(|l| l.strip_prefix("Mode:"))
            .map(|m| m.trim().to_owned())
    }

    /// The last lines of the member's log, for error messages.
    #[must_use]
    pub fn log_tail(&self) -> String {
        self.process.log_tail()
    }

    fn spawn(
        java: &Path,
        classpath: &str,
        base: &Path,
        name: String,
        id: u32,
        ports: [u16; 3],
    ) -> Result<Self, ServerError> {
        let zk = format!(
            "{java} -Xms16m -Xmx256m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 -XX:-UsePerfData \
             -XX:ErrorFile=\"$dir/hs_err_%p.log\" -Djava.io.tmpdir=\"$dir\" \
             -Dzookeeper.cnxTimeout=1000 -Dznode.container.checkIntervalMs=1000 \
             -Dorg.slf4j.simpleLogger.showDateTime=true \
             -Dorg.slf4j.simpleLogger.dateTimeFormat=HH:mm:ss.SSS \
             -cp {classpath} org.apache.zookeeper.server.quorum.QuorumPeerMain \"$dir/zoo.cfg\"",
            java = sh_quote(java),
            classpath = sh_quote(Path::new(classpath)),
        );
        let supervisor =
            Supervisor::member(WHAT, &format!("{}/pgfence-zk.XXXXXX", sh_quote(base)), &zk)?;
        let [client_port, peer_port, election_port] = ports;
        // From here on, dropping the member stops the supervisor and removes `dir`.
        Ok(Self {
            process: Member::new(name, client_port, 30, supervisor),
            id,
            peer_port,
            election_port,
            paused: false,
        })
    }

    /// Writes `zoo.cfg` and `data/myid`. `servers` is empty for a standalone server, else the
    /// ensemble's `server.N=...` lines.
    fn configure(&self, servers: &str) -> Result<(), ServerError> {
        let data = self.dir().join("data");
        std::fs::create_dir_all(&data)?;
        std::fs::write(data.join("myid"), format!("{}\n", self.id))?;
        // A properties file: backslashes are escapes.
        let data_dir = data.to_string_lossy().replace('\\', r"\\");
        let ensemble = if servers.is_empty() {
            String::new()
        } else {
            format!("standaloneEnabled=false\n{servers}")
        };
        let config = format!(
            "tickTime={ZK_TICK_MS}
initLimit=50
syncLimit=10
dataDir={data_dir}
clientPortAddress=127.0.0.1
clientPort={client_port}
minSessionTimeout={ZK_MIN_SESSION_TIMEOUT_MS}
maxSessionTimeout={ZK_MAX_SESSION_TIMEOUT_MS}
admin.enableServer=false
4lw.commands.whitelist=*
forceSync=no
preAllocSize=1024
snapCount=100000
autopurge.purgeInterval=0
{ensemble}",
            client_port = self.process.client_port,
        );
        std::fs::write(self.dir().join("zoo.cfg"), config)?;
        Ok(())
    }

    fn start(&mut self) -> Result<(), ServerError> {
        self.process.start()?;
        self.paused = false;
        Ok(())
    }

    fn signal(&self, signal: &str) -> Result<u32, ServerError> {
        process::signal(WHAT, self.pid(), signal, || {
            format!("member {} is not running", self.process.name)
        })
    }
}

/// A throwaway ZooKeeper ensemble on 127.0.0.1 (one standalone server for a single node).
/// Dropping it stops every member and removes their directories.
#[derive(Debug)]
pub struct ZkEnsemble {
    members: Vec<ZkMember>,
}

impl ZkEnsemble {
    /// Starts a single standalone ZooKeeper server.
    ///
    /// # Errors
    /// As [`ZkEnsemble::start`].
    pub async fn single(zk: Installed<ZooKeeper>) -> Result<Self, ServerError> {
        Self::start(zk, 1).await
    }

    /// Starts `size` members (1 for a standalone server; 3 for an ensemble that survives
    /// losing one) on free ports and waits until every member serves (`srvr` reports its
    /// mode: the ensemble has formed).
    ///
    /// # Errors
    /// [`ServerError::NotInstalled`] when `java` or the ZooKeeper jar is not found;
    /// [`ServerError::StartFailed`] when the ensemble does not form within 60 s (after three
    /// tries with fresh ports; a member that exits ends its try at once).
    pub async fn start(_zk: Installed<ZooKeeper>, size: usize) -> Result<Self, ServerError> {
        assert!(size >= 1, "a ZooKeeper ensemble has at least one member");
        let (java, classpath) = zk_launch()?;
        process::retry(3, || Self::try_start(&java, &classpath, size)).await
    }

    async fn try_start(java: &Path, classpath: &str, size: usize) -> Result<Self, ServerError> {
        let ports = process::free_ports(size * 3)?;
        let base = process::scratch_base();
        let servers = if size == 1 {
            String::new()
        } else {
            ports
                .chunks(3)
                .zip(1..)
                .map(|(p, id)| format!("server.{id}=127.0.0.1:{}:{}\n", p[1], p[2]))
                .collect()
        };
        let mut members = Vec::with_capacity(size);
        for (i, p) in ports.chunks(3).enumerate() {
            let (java, classpath, base) = (java.to_owned(), classpath.to_owned(), base.clone());
            let id = u32::try_from(i + 1).expect("ensemble size fits u32");
            let ports = [p[0], p[1], p[2]];
            let member = process::blocking(move || {
                ZkMember::spawn(&java, &classpath, &base, format!("m{i}"), id, ports)
            })
            .await?;
            member.configure(&servers)?;
            members.push(member);
        }
        let mut ensemble = Self { members };
        for member in &mut ensemble.members {
            member.start()?;
        }
        let deadline = Instant::now() + SERVE_TIMEOUT;
        for i in 0..size {
            ensemble.wait_serving(i, deadline).await?;
        }
        Ok(ensemble)
    }

    /// Waits until member `i` answers `srvr` with a mode.
    async fn wait_serving(&mut self, i: usize, deadline: Instant) -> Result<(), ServerError> {
        self.members[i]
            .process
            .wait_ready("serving", deadline, |port| {
                four_letter(port, "srvr").is_some_and(|reply| reply.contains("Mode:"))
            })
            .await
    }

    /// The members, in start order (`m0` has server id 1).
    #[must_use]
    pub fn members(&self) -> &[ZkMember] {
        &self.members
    }

    /// `127.0.0.1:P1,127.0.0.1:P2,...`, the connect string ZooKeeper clients take.
    #[must_use]
    pub fn connect_string(&self) -> String {
        self.members
            .iter()
            .map(ZkMember::address)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `zk://127.0.0.1:P1,127.0.0.1:P2,...`, the URL that selects pgfence's ZooKeeper issuer.
    #[must_use]
    pub fn url(&self) -> String {
        format!("zk://{}", self.connect_string())
    }

    /// The index of the one running member whose mode is `leader` (`standalone` for a single
    /// server); `None` when no member, or more than one, claims it (an election is under way).
    /// Asks every running member, so it takes a few milliseconds.
    #[must_use]
    pub fn leader(&self) -> Option<usize> {
        let mut leaders = self
            .members
            .iter()
            .enumerate()
            .filter(|(_, m)| m.is_running())
            .filter(|(_, m)| {
                m.mode()
                    .is_some_and(|mode| mode == "leader" || mode == "standalone")
            })
            .map(|(i, _)| i);
        let leader = leaders.next()?;
        leaders.next().is_none().then_some(leader)
    }

    /// Kills member `i` with `SIGKILL` (its JVM's PID only; a paused one too) and waits until
    /// its client port refuses connections. Its data directory stays, for
    /// [`ZkEnsemble::restart`].
    ///
    /// # Errors
    /// The member is not running, or `kill` failed.
    pub fn kill(&mut self, i: usize) -> Result<(), ServerError> {
        let member = &mut self.members[i];
        member.process.kill()?;
        member.paused = false;
        Ok(())
    }

    /// `SIGSTOP`s member `i`: it keeps its sockets but answers nothing, to its clients or its
    /// peers, until [`ZkEnsemble::resume`].
    ///
    /// # Errors
    /// The member is not running, or `kill` failed.
    pub fn pause(&mut self, i: usize) -> Result<(), ServerError> {
        let member = &mut self.members[i];
        member.signal("-STOP")?;
        member.paused = true;
        Ok(())
    }

    /// `SIGCONT`s paused member `i`. It may take a moment to serve again (a paused leader
    /// finds it lost its followers and joins the new leader).
    ///
    /// # Errors
    /// The member is not running, or `kill` failed.
    pub fn resume(&mut self, i: usize) -> Result<(), ServerError> {
        let member = &mut self.members[i];
        member.signal("-CONT")?;
        member.paused = false;
        Ok(())
    }

    /// Starts member `i` again on its ports and data directory (killing it first if it runs)
    /// and waits until it serves again.
    ///
    /// # Errors
    /// [`ServerError::StartFailed`] when it does not serve within 60 s.
    pub async fn restart(&mut self, i: usize) -> Result<(), ServerError> {
        if self.members[i].process.running {
            self.kill(i)?;
        }
        self.members[i].start()?;
        self.wait_serving(i, Instant::now() + SERVE_TIMEOUT).await
    }
}

/// Sends a four-letter command and returns the reply (the server closes the connection after
/// it), or `None` when the server does not answer within about a second.
fn four_letter(port: u16, command: &str) -> Option<String> {
    let mut stream = TcpStream::connect_timeout(
        &SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
        Duration::from_millis(300),
    )
    .ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    stream
        .set_write_timeout(Some(Duration::from_secs(1)))
        .ok()?;
    stream.write_all(command.as_bytes()).ok()?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply).ok()?;
    Some(reply)
}
