//! `pgfence run --on-lease-lost kill|wait`: what happens to the command when its lease is lost.

use crate::support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{TestDb, redis_url, unique_resource};

/// Runs `sh -c script` under `pgfence run` while another owner takes the lock over after
/// 300 ms; returns the exit status, stderr and how long it took.
async fn run_and_steal(policy: &str, script: &str) -> (Option<i32>, String, Duration) {
    let db = TestDb::new().await;
    let res = unique_resource("lost");
    let redis = redis_url().await;
    let started = Instant::now();
    let child = Command::new(env!("CARGO_BIN_EXE_pgfence"))
        .args(["run", "--resource", res.as_str(), "--ttl", "600ms"])
        .args(["--on-lease-lost", policy, "--", "sh", "-c", script])
        .env("DATABASE_URL", db.url())
        .env("REDIS_URL", &redis)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start pgfence");
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Another owner takes the lock over (as after an expiry): the next renewal finds it taken.
    let client = redis::Client::open(redis).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("SET")
        .arg(pgfence::issuer::redis::lock_key(&res))
        .arg("someone-else:999")
        .arg("PX")
        .arg(60_000)
        .query_async(&mut conn)
        .await
        .unwrap();
    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        started.elapsed(),
    )
}

#[tokio::test]
async fn kill_stops_the_command_when_the_lease_is_lost() {
    let (code, stderr, took) = run_and_steal("kill", "exec sleep 20").await;
    assert!(stderr.contains("lost while the command runs"), "{stderr}");
    assert!(stderr.contains("SIGTERM"), "{stderr}");
    assert_eq!(
        code,
        Some(128 + 15),
        "the command died of SIGTERM: {stderr}"
    );
    assert!(took < Duration::from_secs(10), "took {took:?}");
}

#[tokio::test]
async fn wait_lets_the_command_finish() {
    let (code, stderr, took) = run_and_steal("wait", "sleep 2; exit 3").await;
    assert!(stderr.contains("letting it finish"), "{stderr}");
    assert_eq!(code, Some(3), "{stderr}");
    assert!(took >= Duration::from_secs(2), "took {took:?}");
}
