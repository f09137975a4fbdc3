//! A `pgfence run` holder on ZooKeeper whose *process* is paused (SIGSTOP) past its session
//! timeout: the servers expire its session and delete its lock node, a new holder takes the
//! lock and writes, and when the paused process resumes, its shell job's write with the old
//! token is rejected by Postgres, while `pgfence run` reports the lost lease.
//!
//! Needs the binary built with the ZooKeeper issuer (`--features pgfence/zk`, or a workspace
//! build whose pgfence has it) and ZooKeeper installed; skipped (and passing) otherwise.

use crate::support;

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::{TestDb, unique_resource};

const BIN: &str = env!("CARGO_BIN_EXE_pgfence");

/// The session timeout `pgfence run` asks of ZooKeeper (the throwaway server allows 400 ms
/// to 60 s).
const SESSION_TIMEOUT_MS: u64 = 1500;

/// The shell job under `pgfence run`. It claims the invoice with its token (a checked
/// transaction), records its token and tag, waits (at most ~20 s) for the test's trigger
/// file, then, as a zombie that does not know it lost the lock, checks the resource
/// (`pgfence.try_check`, which records a rejection in the audit trail) and writes the row
/// anyway. Exit codes: 42 = the second write was rejected, 0 = it was applied, 10..12 = the
/// job failed earlier.
const JOB: &str = r#"
  set -u
  dir="$PGFENCE_PAUSE_TEST_DIR"
  q() { psql "$DATABASE_URL" -X -qAt -v ON_ERROR_STOP=1 -v VERBOSITY=verbose -c "$1"; }
  q "BEGIN; SELECT pgfence.check('$PGFENCE_RESOURCE', $PGFENCE_TOKEN, $PGFENCE_TAG); UPDATE invoices SET status = 'processing', fence = pgfence.next_fence(fence, $PGFENCE_TOKEN, $PGFENCE_TAG) WHERE id = 42; COMMIT;" >/dev/null 2>"$dir/first.err" || exit 10
  echo "$PGFENCE_TOKEN $PGFENCE_TAG" >"$dir/lease.tmp" && mv "$dir/lease.tmp" "$dir/lease"
  i=0
  while [ ! -e "$dir/go" ]; do
    i=$((i + 1))
    [ "$i" -gt 400 ] && exit 11
    sleep 0.05
  done
  q "SELECT pgfence.try_check('$PGFENCE_RESOURCE', $PGFENCE_TOKEN, $PGFENCE_TAG)" >"$dir/try_check" 2>"$dir/try_check.err" || exit 12
  if q "UPDATE invoices SET status = 'zombie', fence = pgfence.next_fence(fence, $PGFENCE_TOKEN, $PGFENCE_TAG) WHERE id = 42" >/dev/null 2>"$dir/second.err"; then
    exit 0
  fi
  exit 42
"#;

/// The `pgfence run` process (leader of its own process group, which holds the job too) and
/// the scratch directory. On drop, a still-running group is killed (SIGKILL ends stopped
/// processes too) and reaped; the directory is removed.
struct Holder {
    child: Child,
    dir: PathBuf,
    stderr: Arc<Mutex<String>>,
}

impl Holder {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Sends `signal` (`-STOP`, `-CONT`) to the `pgfence run` process alone.
    fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .args([signal, &self.pid().to_string()])
            .status()
            .expect("run kill")
            .success();
        assert!(ok, "kill {signal} {}", self.pid());
    }

    /// The process state letter from /proc (`T` when stopped), if it is still there.
    fn state(&self) -> Option<char> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).ok()?;
        // `pid (comm) S ...`: the state follows the last `)`.
        stat.rsplit_once(')')?.1.trim_start().chars().next()
    }

    /// Waits up to `limit` for the process to exit.
    async fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            // Not reaped yet, so the group id is still this process's: kill the group.
            let group = format!("-{}", self.child.id());
            let _ = Command::new("kill")
                .args(["-KILL", "--", &group])
                .stderr(Stdio::null())
                .status();
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Waits up to `limit` for `cond`, polling every 25 ms.
async fn wait_for(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

#[tokio::test]
async fn a_paused_zookeeper_holder_loses_the_lock_and_its_late_write_is_fenced() {
    use pgfence_testkit::{ZkEnsemble, needs, optional};
    let name = "a_paused_zookeeper_holder_loses_the_lock_and_its_late_write_is_fenced";
    if !pgfence::issuer::IssuerKind::ZooKeeper.is_built() {
        eprintln!("SKIPPED {name}: this build has no zk issuer (--features pgfence/zk)");
        return;
    }
    let Some(zk) = needs::<optional::ZooKeeper>(
        "a_paused_zookeeper_holder_loses_the_lock_and_its_late_write_is_fenced",
    ) else {
        return;
    };
    let test_started = Instant::now();
    let zk = ZkEnsemble::single(zk)
        .await
        .expect("start throwaway ZooKeeper");
    let url = format!("{}?session_timeout_ms={SESSION_TIMEOUT_MS}", zk.url());
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE invoices (id int PRIMARY KEY, status text NOT NULL);
         INSERT INTO invoices VALUES (42, 'open');",
    )
    .await;
    pgfence::guard::guard(
        &db.pool,
        &pgfence::table::TableName::parse("invoices").unwrap(),
    )
    .await
    .unwrap();
    let res = unique_resource("zk-paused");
    let r = res.as_str();
    // The new holder's issuer: its own session, opened before the pause.
    let issuer = pgfence::connect_issuer(&url)
        .await
        .expect("connect to ZooKeeper");
    let dir = std::env::temp_dir().join(format!("pgfence-zk-paused-{}", rand::random::<u64>()));
    std::fs::create_dir(&dir).unwrap();

    // The holder: `pgfence run` with a TTL well past the session timeout, so that what ends
    // its lock is the session expiry, not the TTL (whose timer cannot run while it is
    // stopped anyway). The keep-alive renews every TTL/3 = 3 s.
    let ttl = "9s";
    let mut child = Command::new(BIN);
    child
        .args(["--issuer-url", &url, "run", "--resource", r, "--ttl", ttl])
        .args(["--on-lease-lost", "wait", "--", "sh", "-c", JOB])
        .env("DATABASE_URL", db.url())
        .env("REDIS_URL", "redis://127.0.0.1:1")
        .env("PGFENCE_PAUSE_TEST_DIR", &dir)
        .env_remove("PGFENCE_ISSUER_URL")
        .env_remove("PGFENCE_KEY_PREFIX")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = child.spawn().expect("start pgfence run");
    let pipe = child.stderr.take().unwrap();
    let mut holder = Holder {
        child,
        dir: dir.clone(),
        stderr: Arc::default(),
    };
    let sink = holder.stderr.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            let mut all = sink.lock().unwrap();
            all.push_str(&line);
            all.push('\n');
        }
    });

    // 1. The job claims the row with its token.
    let lease_file = dir.join("lease");
    assert!(
        wait_for(Duration::from_secs(20), || lease_file.exists()).await,
        "the job's first write did not happen: pgfence stderr: {}; job stderr: {}",
        holder.stderr(),
        read(&dir.join("first.err"))
    );
    let recorded = read(&lease_file);
    let (old_token, old_tag) = recorded.trim().split_once(' ').unwrap();
    let (old_token, old_tag): (i64, i32) = (old_token.parse().unwrap(), old_tag.parse().unwrap());
    let (status, fence): (String, i64) =
        sqlx::query_as("SELECT status, fence FROM invoices WHERE id = 42")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(status, "processing", "the job's first write");
    assert_eq!(fence, (old_token << 24) | (i64::from(old_tag) << 12));
    let status = issuer.status(&res).await.unwrap();
    assert_eq!(
        status.token,
        Some(old_token),
        "run holds the lock: {status:?}"
    );
    let ttl_dur = Duration::from_secs(9);
    assert!(
        issuer.acquire(&res, ttl_dur).await.unwrap().is_none(),
        "held by the running holder"
    );

    // 2. Pause the `pgfence run` process (alone: the job waits for the trigger file).
    holder.signal("-STOP");
    let stopped = Instant::now();
    assert!(
        wait_for(Duration::from_secs(2), || holder.state() == Some('T')).await,
        "pgfence run is stopped (state {:?})",
        holder.state()
    );
    // The lock is still held right after the pause: its node lives with the session.
    assert!(
        issuer.acquire(&res, ttl_dur).await.unwrap().is_none(),
        "still held right after the pause"
    );

    // 3. The servers expire the paused session; the new holder gets the lock.
    let new_lease = issuer
        .acquire_wait(&res, ttl_dur, Duration::from_secs(10))
        .await
        .unwrap()
        .expect("the paused holder's session expires within 10 s");
    let took = stopped.elapsed();
    eprintln!(
        "SIGSTOP -> new holder's lease: {took:?} (session timeout {SESSION_TIMEOUT_MS} ms, holder TTL {ttl})"
    );
    assert!(
        took >= Duration::from_secs(1),
        "the lock must outlive the pause until the session expires; took {took:?}"
    );
    assert!(took <= Duration::from_secs(10), "took {took:?}");
    assert_eq!(
        holder.state(),
        Some('T'),
        "still stopped while the lock moved"
    );
    let new_token = new_lease.token().get();
    assert!(
        new_token > old_token,
        "new token {new_token} > old {old_token}"
    );
    let new_tag = i32::from(pgfence::Fencing::from(&new_lease).tag());
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("SELECT pgfence.check($1, $2, $3)")
        .bind(r)
        .bind(new_token)
        .bind(new_tag)
        .execute(&mut *tx)
        .await
        .unwrap();
    let updated = sqlx::query(
        "UPDATE invoices SET status = 'paid', fence = pgfence.next_fence(fence, $1, $2) WHERE id = 42",
    )
    .bind(new_token)
    .bind(new_tag)
    .execute(&mut *tx)
    .await
    .unwrap();
    assert_eq!(updated.rows_affected(), 1);
    tx.commit().await.unwrap();

    // 4. The paused holder resumes. Its keep-alive finds the lock gone: `pgfence run` says so
    //    and, with `--on-lease-lost wait`, lets the job go on.
    holder.signal("-CONT");
    let resumed = Instant::now();
    let noticed = wait_for(Duration::from_secs(12), || {
        holder.stderr().contains("lost while the command runs")
    })
    .await;
    let stderr = holder.stderr();
    assert!(
        noticed,
        "pgfence run did not report the lost lease: {stderr}"
    );
    eprintln!(
        "SIGCONT -> lost lease reported: {:?}; pgfence stderr: {}",
        resumed.elapsed(),
        stderr.trim_end()
    );
    let lost_line = stderr
        .lines()
        .find(|l| l.contains("lost while the command runs"))
        .unwrap();
    assert!(
        lost_line.starts_with(&format!(
            "pgfence: lease on {r} lost while the command runs: "
        )),
        "{lost_line}"
    );
    assert!(
        lost_line.contains("letting it finish (--on-lease-lost wait)")
            && lost_line.contains(&format!(
                "its writes with token {old_token} are still fenced by Postgres"
            )),
        "{lost_line}"
    );
    assert!(
        matches!(holder.child.try_wait(), Ok(None)),
        "the command is left running"
    );

    // The job, still running, now tries its late write with the old token.
    std::fs::write(dir.join("go"), "").unwrap();
    let exit = holder
        .wait_exit(Duration::from_secs(20))
        .await
        .unwrap_or_else(|| panic!("pgfence run did not exit: {}", holder.stderr()));
    let stderr = holder.stderr();
    let second_err = read(&dir.join("second.err"));
    assert_eq!(
        exit.code(),
        Some(42),
        "the job's late write must be rejected (pgfence run exits with the job's code); \
         pgfence stderr: {stderr}; try_check: {}; second write: {second_err}",
        read(&dir.join("try_check"))
    );
    assert_eq!(
        read(&dir.join("try_check")).trim(),
        "f",
        "the resource check refuses the old token"
    );
    assert!(
        read(&dir.join("try_check.err")).contains("recorded in pgfence.audit"),
        "try_check's refusal says where it is recorded: {}",
        read(&dir.join("try_check.err"))
    );
    assert!(
        second_err.contains("PF001")
            && second_err.contains(&format!(
                "presented token {old_token}, current token {new_token}"
            )),
        "{second_err}"
    );
    eprintln!("the paused holder's late write: {}", second_err.trim_end());
    // One lost-lease line, and nothing else went wrong (the release finds another holder).
    assert_eq!(
        stderr.matches("lost while the command runs").count(),
        1,
        "{stderr}"
    );
    assert!(!stderr.contains("could not release"), "{stderr}");

    // 5. The new holder's write stands; nothing of the paused holder's after the pause.
    let (status, fence): (String, i64) =
        sqlx::query_as("SELECT status, fence FROM invoices WHERE id = 42")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(status, "paid", "the new holder's write stands");
    assert_eq!(fence >> 24, new_token, "the row's fence is the new lease's");
    assert_eq!(
        (fence >> 12) & 0xfff,
        i64::from(new_tag),
        "written by the new lease (its tag)"
    );
    // The refused check is in the audit trail, with both tokens.
    let audit: Vec<(Option<String>, i64, Option<i64>, String)> = sqlx::query_as(
        "SELECT resource, presented, current, operation FROM pgfence.audit ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        audit,
        vec![(
            Some(r.to_owned()),
            old_token,
            Some(new_token),
            "check".to_owned()
        )],
        "one audited rejection: the paused holder's check"
    );
    assert_eq!(
        issuer.release(&new_lease).await.unwrap(),
        pgfence::issuer::ReleaseOutcome::Released
    );
    eprintln!("whole test: {:?}", test_started.elapsed());
}
