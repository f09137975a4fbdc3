//! The throwaway ZooKeeper servers: a standalone server, and an ensemble that elects a new
//! leader when its leader is killed. Skipped (and passing) when ZooKeeper is not installed.

use std::time::{Duration, Instant};

use pgfence_testkit::optional::ZooKeeper;
use pgfence_testkit::{ZkEnsemble, needs};

/// Polls `ensemble.leader()` off the runtime until it names a member other than `old`.
async fn wait_new_leader(ensemble: &ZkEnsemble, old: usize, within: Duration) -> Option<usize> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Some(leader) = tokio::task::block_in_place(|| ensemble.leader())
            && leader != old
        {
            return Some(leader);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_server_is_standalone() {
    let Some(zk) = needs::<ZooKeeper>("single_server_is_standalone") else {
        return;
    };
    let started = Instant::now();
    let zk = ZkEnsemble::single(zk)
        .await
        .expect("start throwaway ZooKeeper");
    eprintln!("standalone ZooKeeper serving after {:?}", started.elapsed());
    let member = &zk.members()[0];
    assert_eq!(member.mode().as_deref(), Some("standalone"));
    assert_eq!(zk.leader(), Some(0));
    assert!(member.is_running());
    assert!(member.pid().is_some());
    assert_eq!(
        zk.connect_string(),
        format!("127.0.0.1:{}", member.client_port())
    );
    assert_eq!(zk.url(), format!("zk://{}", zk.connect_string()));
    let dir = member.dir().to_owned();
    assert!(dir.join("zoo.cfg").is_file());
    drop(zk);
    assert!(
        !dir.exists(),
        "dropping the server removes {}",
        dir.display()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ensemble_elects_a_new_leader_after_a_kill() {
    let Some(zk) = needs::<ZooKeeper>("ensemble_elects_a_new_leader_after_a_kill") else {
        return;
    };
    let started = Instant::now();
    let mut zk = ZkEnsemble::start(zk, 3)
        .await
        .expect("start throwaway ensemble");
    eprintln!(
        "3-member ZooKeeper ensemble formed after {:?}",
        started.elapsed()
    );
    assert_eq!(zk.connect_string().split(',').count(), 3);
    let modes: Vec<Option<String>> = zk.members().iter().map(|m| m.mode()).collect();
    assert_eq!(
        modes
            .iter()
            .filter(|m| m.as_deref() == Some("leader"))
            .count(),
        1,
        "one leader: {modes:?}"
    );
    assert_eq!(
        modes
            .iter()
            .filter(|m| m.as_deref() == Some("follower"))
            .count(),
        2,
        "two followers: {modes:?}"
    );
    let old = zk.leader().expect("a leader");

    let killed = Instant::now();
    zk.kill(old).expect("kill the leader");
    assert!(!zk.members()[old].is_running());
    assert_eq!(zk.members()[old].mode(), None);
    let new = wait_new_leader(&zk, old, Duration::from_secs(20))
        .await
        .unwrap_or_else(|| {
            let logs: Vec<String> = zk.members().iter().map(|m| m.log_tail()).collect();
            panic!("no new leader within 20 s:\n{}", logs.join("\n----\n"))
        });
    eprintln!(
        "new leader {} elected {:?} after killing leader {}",
        zk.members()[new].name(),
        killed.elapsed(),
        zk.members()[old].name()
    );

    // The killed member comes back on its ports and data, as a follower.
    let restarted = Instant::now();
    zk.restart(old).await.expect("restart the old leader");
    eprintln!(
        "killed member serving again after {:?}",
        restarted.elapsed()
    );
    assert_eq!(zk.members()[old].mode().as_deref(), Some("follower"));
    assert_eq!(zk.leader(), Some(new));

    // A paused follower answers nothing; the leader keeps its quorum.
    let follower = (0..3).find(|&i| i != new).expect("a follower");
    zk.pause(follower).expect("pause a follower");
    assert!(zk.members()[follower].is_paused());
    assert_eq!(zk.members()[follower].mode(), None);
    assert_eq!(zk.leader(), Some(new));
    zk.resume(follower).expect("resume the follower");
    assert_eq!(zk.members()[follower].mode().as_deref(), Some("follower"));
}
