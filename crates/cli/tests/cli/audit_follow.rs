//! `pgfence audit --follow`: existing rejections first, then new ones as they are recorded.

use crate::support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use support::{TestDb, token};

#[tokio::test]
async fn follow_prints_new_rejections_as_they_arrive() {
    let db = TestDb::new().await;
    let fence = pgfence::Fence::new(db.pool.clone());
    let res = pgfence::Resource::new("follow:me").unwrap();
    fence.check(&db.pool, &res, token(5)).await.unwrap();
    assert!(fence.check(&db.pool, &res, token(1)).await.is_err()); // an old rejection

    let mut child = Command::new(env!("CARGO_BIN_EXE_pgfence"))
        .args(["audit", "--follow", "--json", "--resource", "follow:*"])
        .env("DATABASE_URL", db.url())
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start pgfence");
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let next = |what: &str| {
        let line = rx
            .recv_timeout(Duration::from_secs(15))
            .unwrap_or_else(|_| panic!("no line for {what}"));
        serde_json::from_str::<serde_json::Value>(&line).expect("one JSON object per line")
    };
    assert_eq!(next("the existing rejection")["presented"], 1);

    // A new rejection, while it follows.
    assert!(fence.check(&db.pool, &res, token(2)).await.is_err());
    let row = next("the new rejection");
    assert_eq!(row["presented"], 2);
    assert_eq!(row["resource"], "follow:me");
    let _ = child.kill();
    let _ = child.wait();
}
