//! pgfence's metrics through the Prometheus exporter: a fenced write, a stale one, then the
//! exposition text. `cargo run --example metrics --features metrics [-- --serve 127.0.0.1:9464]`
//! serves it on `/metrics` until interrupted (a plain TCP responder, no HTTP framework).
//! Uses `DATABASE_URL` when set, else a throwaway PostgreSQL.

// An example whose output is its standard output.
#![allow(clippy::print_stdout)]

use metrics_exporter_prometheus::PrometheusBuilder;
use pgfence::{FenceToken, Repository, table::TableName};
use tokio::io::AsyncWriteExt;

#[derive(Clone)]
struct Account {
    id: i64,
    balance: i64,
}

pgfence::fenced_table!(Account { table: "metrics_demo_account", key: id: i64, columns: [balance] });

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let handle = PrometheusBuilder::new().install_recorder()?;

    let (url, _server) = pgfence_testkit::url_or_start(
        pgfence_testkit::Kind::Postgres,
        std::env::var("DATABASE_URL").ok().as_deref(),
    )
    .await?;
    let pool = sqlx::PgPool::connect(&url).await?;
    pgfence::admin::migrate(&pool).await?;
    let table = TableName::new("public", &format!("metrics_demo_{}", std::process::id()))?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS {t}; CREATE TABLE {t} (id bigint PRIMARY KEY, balance bigint NOT NULL);
         INSERT INTO {t} VALUES (1, 0);",
        t = table.quoted()
    )))
    .execute(&pool)
    .await?;
    pgfence::guard::guard(&pool, &table).await?;
    let repo = Repository::<Account>::for_table(pool.clone(), table.clone())?;
    let (newer, older) = (FenceToken::new(2)?, FenceToken::new(1)?);
    repo.update(
        &pool,
        newer,
        &Account {
            id: 1,
            balance: 100,
        },
    )
    .await?;
    let stale = repo
        .update(&pool, older, &Account { id: 1, balance: -1 })
        .await;
    assert!(stale.is_err_and(|e| e.is_stale()));
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP TABLE {}",
        table.quoted()
    )))
    .execute(&pool)
    .await?;

    let text = handle.render();
    print!("{text}");
    let mut args = std::env::args().skip(1);
    if let (Some(flag), Some(addr)) = (args.next(), args.next())
        && flag == "--serve"
    {
        let listener = tokio::net::TcpListener::bind(&addr).await?;
        eprintln!("serving http://{addr}/metrics");
        loop {
            let (mut socket, _) = listener.accept().await?;
            let body = handle.render();
            let reply = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            socket.write_all(reply.as_bytes()).await?;
        }
    }
    Ok(())
}
