//! The throwaway replicated PostgreSQL: an asynchronous standby's promotion loses what it had
//! not received and starts a new timeline behind the same address; a synchronous standby's
//! loses nothing that was acknowledged, and a commit the cut-off standby cannot confirm is
//! never acknowledged.

use std::time::Duration;

use pgfence_testkit::{PgReplicaSet, Replication};

const TABLE: &str = "CREATE TABLE t (id int PRIMARY KEY, v text NOT NULL)";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_promotion_loses_commits_after_the_cut_off_and_starts_a_new_timeline() {
    let mut set = tokio::time::timeout(
        Duration::from_secs(120),
        PgReplicaSet::start(Replication::Async),
    )
    .await
    .expect("start within 120 s")
    .expect("replica set");
    assert_eq!(set.replication(), Replication::Async);
    set.sql(TABLE).await.unwrap();
    set.sql("INSERT INTO t VALUES (1, 'before')").await.unwrap();
    set.wait_replayed().await.unwrap();
    assert_eq!(set.standby_sql("SELECT v FROM t").await.unwrap(), "before");
    assert_eq!(
        set.standby_sql("SELECT pg_is_in_recovery()").await.unwrap(),
        "t"
    );
    let timeline = set.timeline().await.unwrap();
    assert_eq!(set.standby_timeline().await.unwrap(), timeline);

    set.cut_off_standby().await.unwrap();
    assert!(set.is_cut_off());
    assert!(
        set.wait_replayed().await.is_err(),
        "a cut-off standby cannot catch up"
    );
    // Acknowledged by the primary (psql succeeded), through the stable address.
    set.sql("INSERT INTO t VALUES (2, 'after the cut-off')")
        .await
        .unwrap();
    assert_eq!(
        set.primary_sql("SELECT count(*) FROM t").await.unwrap(),
        "2"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        set.standby_sql("SELECT count(*) FROM t").await.unwrap(),
        "1",
        "the cut-off standby received a commit"
    );

    let old_primary = set.primary_port();
    let standby = set.standby_port().unwrap();
    let url = set.url();
    let failover = set.fail_over().await.unwrap();
    assert_eq!(failover.old_port, old_primary);
    assert_eq!(failover.new_port, standby);
    assert_eq!(failover.old_timeline, timeline);
    assert_eq!(failover.new_timeline, timeline + 1, "{failover:?}");
    assert!(failover.kill <= failover.took && failover.took < Duration::from_secs(60));
    assert_eq!(set.timeline().await.unwrap(), timeline + 1);
    assert_eq!(set.url(), url, "the stable address moved");
    assert_eq!(set.primary_port(), standby);
    assert_eq!(set.standby_port(), None);
    assert!(!set.is_cut_off());
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", old_primary)).is_err(),
        "the old primary still listens"
    );

    // The stable address reaches the new primary: the commit after the cut-off is gone, and
    // it accepts writes.
    assert_eq!(set.sql("SELECT pg_is_in_recovery()").await.unwrap(), "f");
    assert_eq!(
        set.sql("SELECT string_agg(v, ',' ORDER BY id) FROM t")
            .await
            .unwrap(),
        "before"
    );
    set.sql("INSERT INTO t VALUES (3, 'on the new primary')")
        .await
        .unwrap();
    assert_eq!(set.sql("SELECT count(*) FROM t").await.unwrap(), "2");
    assert!(set.fail_over().await.is_err(), "no standby left to promote");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_promotion_keeps_every_acknowledged_commit() {
    let mut set = tokio::time::timeout(
        Duration::from_secs(120),
        PgReplicaSet::start(Replication::Sync),
    )
    .await
    .expect("start within 120 s")
    .expect("replica set");
    assert_eq!(
        set.primary_sql("SELECT current_setting('synchronous_standby_names') || ' ' || current_setting('synchronous_commit')")
            .await
            .unwrap(),
        "* on"
    );
    assert_eq!(
        set.primary_sql("SELECT sync_state FROM pg_stat_replication")
            .await
            .unwrap(),
        "sync"
    );
    set.sql(TABLE).await.unwrap();
    // Each INSERT its own acknowledged commit, right up to the kill (no wait for the standby).
    for i in 0..20 {
        set.sql(&format!("INSERT INTO t VALUES ({i}, 'acknowledged')"))
            .await
            .unwrap();
    }
    let timeline = set.timeline().await.unwrap();

    // Synchronous replication really waits: with the standby cut off, a commit is not
    // acknowledged.
    set.cut_off_standby().await.unwrap();
    let waiting = tokio::time::timeout(
        Duration::from_secs(2),
        set.primary_sql("INSERT INTO t VALUES (100, 'never acknowledged')"),
    )
    .await;
    assert!(
        waiting.is_err(),
        "a commit returned without the synchronous standby: {waiting:?}"
    );

    let failover = set.fail_over().await.unwrap();
    assert_eq!(failover.new_timeline, timeline + 1);
    assert_eq!(
        set.sql("SELECT count(*) FROM t WHERE v = 'acknowledged'")
            .await
            .unwrap(),
        "20"
    );
    assert_eq!(
        set.sql("SELECT count(*) FROM t WHERE id = 100")
            .await
            .unwrap(),
        "0"
    );
    // The new primary has no synchronous standby to wait for: it accepts writes.
    tokio::time::timeout(
        Duration::from_secs(10),
        set.sql("INSERT INTO t VALUES (200, 'new')"),
    )
    .await
    .expect("the new primary waits for a standby")
    .unwrap();
}
