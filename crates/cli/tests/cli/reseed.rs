//! `pgfence reseed`: raising a resource's token counter.

use crate::common::Cli;
use crate::support;

use support::{TestDb, unique_resource};

#[tokio::test]
async fn reseed_raises_the_counter() {
    let db = TestDb::new().await;
    let cli = Cli::new(&db).await;
    let res = unique_resource("cli-reseed");
    let r = res.as_str();
    pgfence::Fence::new(db.pool.clone())
        .check(&db.pool, &res, support::token(41))
        .await
        .unwrap();
    assert!(cli.ok(&["reseed", r]).contains("raised from 0 to 41"));
    assert!(
        cli.ok(&["reseed", r, "--floor", "10"])
            .contains("unchanged")
    );
    assert!(
        cli.ok(&["lock", "acquire", r, "--ttl", "1s"])
            .contains("token=42")
    );
    assert!(
        cli.fails(&["reseed", r, "--floor", "-1"])
            .contains("negative")
    );
}
