//! `--issuer-url` / `PGFENCE_ISSUER_URL` and `--key-prefix` / `PGFENCE_KEY_PREFIX`: the
//! Redis path always; etcd and ZooKeeper when the binary has them (`--features etcd` / `zk`,
//! or a workspace build whose pgfence has them: `cargo test` at the root) and they are
//! installed.

use crate::support;

use std::process::{Command, Output, Stdio};

use redis::AsyncCommands;
use support::{TestDb, redis_url, unique_resource};

const BIN: &str = env!("CARGO_BIN_EXE_pgfence");

/// `pgfence ARGS` with `env` set and no REDIS_URL / PGFENCE_* unless given.
fn pgfence(env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut c = Command::new(BIN);
    c.args(args)
        .env_remove("REDIS_URL")
        .env_remove("PGFENCE_ISSUER_URL")
        .env_remove("PGFENCE_KEY_PREFIX")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null());
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run pgfence")
}

fn ok(env: &[(&str, &str)], args: &[&str]) -> String {
    let out = pgfence(env, args);
    assert!(
        out.status.success(),
        "pgfence {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn json(env: &[(&str, &str)], args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&ok(env, args)).unwrap()
}

#[tokio::test]
async fn issuer_url_selects_redis_and_falls_back_to_redis_url() {
    let db = TestDb::new().await;
    let db_url = db.url();
    let redis = redis_url().await;
    let res = unique_resource("cli-issuer-url");
    let r = res.as_str();

    // --issuer-url, with no REDIS_URL at all.
    let env = [("DATABASE_URL", db_url.as_str())];
    let acquired = json(
        &env,
        &[
            "--issuer-url",
            &redis,
            "lock",
            "acquire",
            r,
            "--ttl",
            "30s",
            "--json",
        ],
    );
    let (token, owner) = (
        acquired["token"].as_i64().unwrap(),
        acquired["owner"].as_str().unwrap().to_owned(),
    );
    // PGFENCE_ISSUER_URL, and REDIS_URL pointing nowhere is ignored.
    let env_url = [
        ("DATABASE_URL", db_url.as_str()),
        ("PGFENCE_ISSUER_URL", redis.as_str()),
        ("REDIS_URL", "redis://127.0.0.1:1"),
    ];
    let status = json(&env_url, &["lock", "status", r, "--json"]);
    assert_eq!(status["owner"].as_str(), Some(owner.as_str()));
    let released = json(
        &env_url,
        &[
            "lock",
            "release",
            r,
            "--owner",
            &owner,
            "--token",
            &token.to_string(),
            "--json",
        ],
    );
    assert_eq!(released["result"], "released");
    // REDIS_URL alone still works.
    let env_redis = [
        ("DATABASE_URL", db_url.as_str()),
        ("REDIS_URL", redis.as_str()),
    ];
    assert!(ok(&env_redis, &["lock", "status", r]).contains("free; counter="));
    let out = ok(
        &env_redis,
        &[
            "run",
            "--resource",
            r,
            "--ttl",
            "5s",
            "--",
            "sh",
            "-c",
            "echo token=$PGFENCE_TOKEN",
        ],
    );
    assert_eq!(out.trim(), format!("token={}", token + 1));

    // No URL at all: says how to give one.
    let out = pgfence(&env, &["lock", "status", r]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--issuer-url") && err.contains("PGFENCE_ISSUER_URL"),
        "{err}"
    );
    // An unknown scheme is refused, in one line.
    let out = pgfence(
        &env,
        &["--issuer-url", "memcached://x", "lock", "status", r],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("invalid issuer URL"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}

#[tokio::test]
async fn key_prefix_separates_locks_and_counters() {
    let db = TestDb::new().await;
    let db_url = db.url();
    let redis = redis_url().await;
    let res = unique_resource("cli-prefix");
    let r = res.as_str();
    let plain = [
        ("DATABASE_URL", db_url.as_str()),
        ("REDIS_URL", redis.as_str()),
    ];
    let prefixed = [
        ("DATABASE_URL", db_url.as_str()),
        ("REDIS_URL", redis.as_str()),
        ("PGFENCE_KEY_PREFIX", "cli-app"),
    ];

    // Reseed under the prefix: the default prefix's counter is untouched.
    assert!(ok(&prefixed, &["reseed", r, "--floor", "50"]).contains("raised from 0 to 50"));
    let a = json(&prefixed, &["lock", "acquire", r, "--ttl", "30s", "--json"]);
    assert_eq!(a["token"].as_i64(), Some(51));
    // The same resource without the prefix: another lock, another counter.
    let b = json(&plain, &["lock", "acquire", r, "--ttl", "30s", "--json"]);
    assert_eq!(b["token"].as_i64(), Some(1));
    // --key-prefix on the command line, same as the variable.
    let status = json(
        &plain,
        &["--key-prefix", "cli-app", "lock", "status", r, "--json"],
    );
    assert_eq!(status["owner"], a["owner"]);
    assert_eq!(status["counter"].as_i64(), Some(51));

    let mut conn = redis::Client::open(redis.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let held: Option<String> = conn.get(format!("cli-app:{{{r}}}:lock")).await.unwrap();
    assert_eq!(held, Some(format!("{}:51", a["owner"].as_str().unwrap())));

    // Releasing through the wrong prefix leaves the lock alone (exit 2).
    let release = |env: &[(&str, &str)], lease: &serde_json::Value| {
        pgfence(
            env,
            &[
                "lock",
                "release",
                r,
                "--owner",
                lease["owner"].as_str().unwrap(),
                "--token",
                &lease["token"].to_string(),
            ],
        )
    };
    assert_eq!(release(&plain, &a).status.code(), Some(2));
    assert_eq!(release(&prefixed, &a).status.code(), Some(0));
    assert_eq!(release(&plain, &b).status.code(), Some(0));

    // A bad prefix is refused before anything is touched.
    for bad in ["a b", "{x}", ""] {
        let out = pgfence(&plain, &["--key-prefix", bad, "lock", "status", r]);
        assert_eq!(out.status.code(), Some(1), "{bad:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("invalid key prefix"), "{bad:?}: {err}");
    }
    let _: () = conn
        .del(&[
            format!("cli-app:{{{r}}}:fence"),
            pgfence::issuer::redis::counter_key(&res),
        ])
        .await
        .unwrap();
}

/// The binary links the same pgfence as this test (one build), so this says what it has.
fn built(kind: pgfence::issuer::IssuerKind) -> bool {
    kind.is_built()
}

#[tokio::test]
async fn etcd_url_without_the_feature_says_how_to_enable_it() {
    if built(pgfence::issuer::IssuerKind::Etcd) {
        eprintln!("SKIPPED etcd_url_without_the_feature: this build has the etcd issuer");
        return;
    }
    let out = pgfence(
        &[],
        &[
            "--issuer-url",
            "etcd://127.0.0.1:2379",
            "lock",
            "status",
            "r",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("`etcd` feature") && err.contains("--features etcd"),
        "{err}"
    );
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}

#[tokio::test]
async fn lock_run_and_reseed_with_etcd() {
    use pgfence_testkit::{EtcdCluster, needs, optional};
    if !built(pgfence::issuer::IssuerKind::Etcd) {
        eprintln!("SKIPPED lock_run_and_reseed_with_etcd: this build has no etcd issuer");
        return;
    }
    let Some(etcd) = needs::<optional::Etcd>("lock_run_and_reseed_with_etcd") else {
        return;
    };
    let node = EtcdCluster::single(etcd)
        .await
        .expect("start throwaway etcd");
    let db = TestDb::new().await;
    let db_url = db.url();
    let url = node.url();
    let env = [
        ("DATABASE_URL", db_url.as_str()),
        ("PGFENCE_ISSUER_URL", url.as_str()),
        ("REDIS_URL", "redis://127.0.0.1:1"),
    ];
    let res = unique_resource("cli-etcd");
    let r = res.as_str();
    let a = json(&env, &["lock", "acquire", r, "--ttl", "30s", "--json"]);
    let token = a["token"].as_i64().unwrap();
    let status = json(&env, &["lock", "status", r, "--json"]);
    assert_eq!(status["owner"], a["owner"]);
    let out = pgfence(
        &env,
        &[
            "lock",
            "release",
            r,
            "--owner",
            a["owner"].as_str().unwrap(),
            "--token",
            &token.to_string(),
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let out = ok(
        &env,
        &[
            "run",
            "--resource",
            r,
            "--ttl",
            "3s",
            "--",
            "sh",
            "-c",
            "echo $PGFENCE_TOKEN",
        ],
    );
    assert!(out.trim().parse::<i64>().unwrap() > token, "{out}");
    assert!(ok(&env, &["reseed", r, "--floor", "5"]).contains("nothing to reseed"));
}

#[tokio::test]
async fn run_status_and_reseed_with_zookeeper() {
    use pgfence_testkit::{ZkEnsemble, needs, optional};
    if !built(pgfence::issuer::IssuerKind::ZooKeeper) {
        eprintln!("SKIPPED run_status_and_reseed_with_zookeeper: this build has no zk issuer");
        return;
    }
    let Some(zk) = needs::<optional::ZooKeeper>("run_status_and_reseed_with_zookeeper") else {
        return;
    };
    let node = ZkEnsemble::single(zk)
        .await
        .expect("start throwaway ZooKeeper");
    let db = TestDb::new().await;
    let db_url = db.url();
    let url = node.url();
    let env = [
        ("DATABASE_URL", db_url.as_str()),
        ("PGFENCE_ISSUER_URL", url.as_str()),
        ("REDIS_URL", "redis://127.0.0.1:1"),
    ];
    let res = unique_resource("cli-zk");
    let r = res.as_str();
    // The lock lives as long as `run`: the command sees its token, and status sees the holder.
    let script = format!("echo $PGFENCE_TOKEN; '{BIN}' lock status \"$PGFENCE_RESOURCE\" --json");
    let out = ok(
        &env,
        &[
            "run",
            "--resource",
            r,
            "--ttl",
            "3s",
            "--",
            "sh",
            "-c",
            &script,
        ],
    );
    let mut lines = out.lines();
    let token: i64 = lines.next().unwrap().trim().parse().unwrap();
    let status: serde_json::Value = serde_json::from_str(lines.next().unwrap()).unwrap();
    assert_eq!(status["token"].as_i64(), Some(token), "{out}");
    // After `run`, the lock is gone (released).
    let status = json(&env, &["lock", "status", r, "--json"]);
    assert!(status["owner"].is_null(), "{status}");
    assert!(status["counter"].as_i64().unwrap() > token, "{status}");
    // `lock acquire` refuses: the lock would end with the command.
    let out = pgfence(&env, &["lock", "acquire", r, "--ttl", "30s"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("pgfence run"), "{err}");
    assert!(ok(&env, &["reseed", r, "--floor", "5"]).contains("nothing to reseed"));
    // A second run gets a larger token.
    let out = ok(
        &env,
        &[
            "run",
            "--resource",
            r,
            "--ttl",
            "3s",
            "--",
            "sh",
            "-c",
            "echo $PGFENCE_TOKEN",
        ],
    );
    assert!(out.trim().parse::<i64>().unwrap() > token, "{out}");
    // The race demo runs on this issuer too: the zombie's write is rejected.
    let out = ok(&env, &["simulate"]);
    assert!(out.contains("issuer:   zk://"), "{out}");
    assert!(out.contains("fencing works"), "{out}");
}

/// The PostgreSQL issuer from the CLI: `PGFENCE_ISSUER_URL` = the database itself, no Redis.
/// lock acquire / status / release, `run` (whose child checks its token with
/// `pgfence.try_check`), `reseed` (nothing to reseed) and `doctor`.
#[tokio::test]
async fn lock_run_reseed_and_doctor_with_the_postgres_issuer() {
    let db = TestDb::new().await;
    let db_url = db.url();
    let env = [
        ("DATABASE_URL", db_url.as_str()),
        ("PGFENCE_ISSUER_URL", db_url.as_str()),
        ("REDIS_URL", "redis://127.0.0.1:1"),
    ];
    let res = unique_resource("cli-pg");
    let r = res.as_str();
    let a = json(&env, &["lock", "acquire", r, "--ttl", "30s", "--json"]);
    let token = a["token"].as_i64().unwrap();
    assert_eq!(token, 1);
    let status = json(&env, &["lock", "status", r, "--json"]);
    assert_eq!(status["owner"], a["owner"]);
    assert_eq!(status["counter"].as_i64(), Some(1));
    let held: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pgfence.issuer_lock WHERE resource = $1")
            .bind(r)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(held, 1, "the lock is a row of the database");
    let released = json(
        &env,
        &[
            "lock",
            "release",
            r,
            "--owner",
            a["owner"].as_str().unwrap(),
            "--token",
            &token.to_string(),
            "--json",
        ],
    );
    assert_eq!(released["result"], "released");
    let script = format!(
        "psql -X -q -t -A -d \"$DATABASE_URL\" -c \"SELECT pgfence.try_check('{r}', $PGFENCE_TOKEN)\"; echo token=$PGFENCE_TOKEN"
    );
    let out = ok(
        &env,
        &[
            "run",
            "--resource",
            r,
            "--ttl",
            "5s",
            "--",
            "sh",
            "-c",
            &script,
        ],
    );
    assert_eq!(out.trim(), "t\ntoken=2", "{out}");
    assert!(ok(&env, &["reseed", r, "--floor", "5"]).contains("nothing to reseed"));
    let out = pgfence(&env, &["doctor"]);
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
