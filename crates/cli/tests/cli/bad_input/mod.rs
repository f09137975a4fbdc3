//! Bad-input catalogue: hostile or malformed inputs across the library. Each case must fail
//! with the expected typed error AND leave Postgres (user tables, pgfence's tables, catalog:
//! relations, columns, triggers, functions) and Redis (every key, value and TTL class)
//! exactly as they were.
//!
//! One table-driven test: the cases share one database and one Redis, and a snapshot is taken
//! before and after each. A second table-driven test does the same for the `pgfence` binary.

use crate::common::{BIN, Cli};
use crate::support;

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::process::Command;
use std::time::Duration;

use pgfence::token::StoredFence;
use pgfence::{
    Error, Fence, FenceToken, FencedTable, RedisIssuer, Repository, Resource,
    issuer::redis::{counter_key, lock_key},
    table::{PgQuery, TableName},
};
use redis::AsyncCommands;
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgPool, Row};
use support::{TestDb, redis_url};

mod every_argument;

// ---------------------------------------------------------------------------------------------
// Snapshots.

#[derive(Debug, PartialEq, Eq)]
struct PgSnapshot {
    catalog: Vec<String>,
    data: BTreeMap<String, String>,
}

async fn pg_snapshot(pool: &PgPool) -> PgSnapshot {
    let catalog: Vec<String> = sqlx::query_scalar(
        r"SELECT x FROM (
            SELECT format('rel %s.%s kind=%s', n.nspname, c.relname, c.relkind) AS x
              FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname NOT IN ('pg_catalog', 'information_schema')
               AND n.nspname NOT LIKE 'pg_toast%' AND n.nspname NOT LIKE 'pg_temp%'
            UNION ALL
            SELECT format('col %s.%s.%s %s notnull=%s default=%s', n.nspname, c.relname, a.attname,
                          format_type(a.atttypid, a.atttypmod), a.attnotnull,
                          pg_get_expr(d.adbin, d.adrelid))
              FROM pg_attribute a
              JOIN pg_class c ON c.oid = a.attrelid
              JOIN pg_namespace n ON n.oid = c.relnamespace
              LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
             WHERE a.attnum > 0 AND NOT a.attisdropped
               AND n.nspname NOT IN ('pg_catalog', 'information_schema')
               AND n.nspname NOT LIKE 'pg_toast%' AND n.nspname NOT LIKE 'pg_temp%'
            UNION ALL
            SELECT format('trigger %s %s enabled=%s', t.tgrelid::regclass, t.tgname, t.tgenabled)
              FROM pg_trigger t WHERE NOT t.tgisinternal
            UNION ALL
            SELECT format('fn %s.%s(%s)', n.nspname, p.proname, pg_get_function_identity_arguments(p.oid))
              FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
             WHERE n.nspname NOT IN ('pg_catalog', 'information_schema')
            UNION ALL
            SELECT format('schema %s', nspname) FROM pg_namespace
        ) s ORDER BY x",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let tables: Vec<(String, String)> = sqlx::query_as(
        r"SELECT n.nspname::text, c.relname::text
            FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
           WHERE c.relkind IN ('r', 'p')
             AND n.nspname NOT IN ('pg_catalog', 'information_schema')
             AND n.nspname NOT LIKE 'pg_toast%' AND n.nspname NOT LIKE 'pg_temp%'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let mut data = BTreeMap::new();
    for (schema, table) in tables {
        let name = TableName::new(&schema, &table).unwrap();
        let digest: String = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) || ':' || coalesce(md5(string_agg(t::text, E'\\n' ORDER BY t::text)), '') FROM {} t",
            name.quoted()
        )))
        .fetch_one(pool)
        .await
        .unwrap();
        data.insert(name.quoted(), digest);
    }
    PgSnapshot { catalog, data }
}

/// Every Redis key with its type, value (strings) and TTL class.
async fn redis_snapshot(conn: &mut redis::aio::MultiplexedConnection) -> BTreeMap<String, String> {
    let keys: Vec<String> = conn.keys("*").await.unwrap();
    let mut out = BTreeMap::new();
    for key in keys {
        let kind: String = redis::cmd("TYPE")
            .arg(&key)
            .query_async(conn)
            .await
            .unwrap();
        let value: Option<String> = if kind == "string" {
            conn.get(&key).await.unwrap()
        } else {
            None
        };
        let pttl: i64 = conn.pttl(&key).await.unwrap();
        // Locks in this test are taken for 600 s; "as set" means not extended or shortened.
        let ttl = match pttl {
            -1 => "persistent",
            p if p < 500_000 => "short",
            p if p <= 600_000 => "as set",
            _ => "long",
        };
        out.insert(key, format!("{kind} {value:?} {ttl}"));
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Tables declared by hand, to feed the repository hostile declarations.

macro_rules! hand_table {
    ($name:ident, $table:expr, $keys:expr, $cols:expr) => {
        struct $name;
        impl FencedTable for $name {
            type Key = i32;
            const TABLE: &'static str = $table;
            const KEY_COLUMNS: &'static [&'static str] = $keys;
            const COLUMNS: &'static [&'static str] = $cols;
            fn bind_key(&self, q: PgQuery) -> PgQuery {
                q.bind(1_i32)
            }
            fn bind_columns(&self, q: PgQuery) -> PgQuery {
                Self::COLUMNS.iter().fold(q, |q, _| q.bind("x"))
            }
            fn bind_key_value(key: &i32, q: PgQuery) -> PgQuery {
                q.bind(*key)
            }
        }
    };
}

hand_table!(Ghost, "no_such_table", &["id"], &["v"]);
hand_table!(HostileColumn, "victim", &["id"], &["v\" = 'pwned', \"id"]);
hand_table!(CommentColumn, "victim", &["id"], &["v = 'pwned' -- "]);
hand_table!(DeclaresFence, "victim", &["id"], &["v", "fence"]);
hand_table!(NoKey, "victim", &[], &["v"]);
hand_table!(DuplicateColumn, "victim", &["id"], &["v", "v"]);
hand_table!(
    OverlongColumn,
    "victim",
    &["id"],
    &["vvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvv"]
);
hand_table!(
    HostileTable,
    "victim\"; DROP TABLE victim; --",
    &["id"],
    &["v"]
);

fn repo<T: FencedTable>(pool: &PgPool) -> Result<Repository<T>, Error> {
    Repository::<T>::new(pool.clone())
}

fn tok(n: i64) -> FenceToken {
    FenceToken::new(n).unwrap()
}

async fn pg_connect(url: &str) -> Result<(), Error> {
    // A bounded wait: an unreachable server must fail, not hang.
    PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(3))
        .connect(url)
        .await
        .map(drop)
        .map_err(Error::from)
}

type CaseFuture<'a> = Pin<Box<dyn Future<Output = Result<(), Error>> + 'a>>;

struct Case<'a> {
    name: &'static str,
    run: CaseFuture<'a>,
    expect: fn(&Error) -> bool,
}

macro_rules! case {
    ($cases:ident, $name:expr, $run:expr, $expect:pat $(if $guard:expr)?) => {
        $cases.push(Case {
            name: $name,
            run: Box::pin($run),
            expect: |e: &Error| matches!(e, $expect $(if $guard)?),
        });
    };
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::too_many_lines)]
async fn hostile_inputs_fail_typed_and_change_nothing() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE victim (id int PRIMARY KEY, v text NOT NULL);
         INSERT INTO victim VALUES (1, 'original');
         CREATE TABLE textfence (id int PRIMARY KEY, fence text);
         INSERT INTO textfence VALUES (1, 'not a number');
         CREATE VIEW victim_view AS SELECT * FROM victim;
         CREATE TABLE acct (id int PRIMARY KEY, balance bigint NOT NULL);
         INSERT INTO acct VALUES (1, 100);",
    )
    .await;
    let pool = &db.pool;
    let victim = TableName::parse("victim").unwrap();
    pgfence::guard::guard(pool, &victim).await.unwrap();
    pgfence::guard::guard(pool, &TableName::parse("acct").unwrap())
        .await
        .unwrap();
    // The row as token 5's lease writes it (a stored fence packs token, tag and sequence).
    let fence_5 = StoredFence::lease(tok(5), 0).get();
    db.exec(&format!(
        "UPDATE acct SET balance = 90, fence = {fence_5} WHERE id = 1"
    ))
    .await;
    let lower_to_4 = format!(
        "UPDATE acct SET balance = 0, fence = {} WHERE id = 1",
        StoredFence::lease(tok(4), 0).get()
    );
    Fence::new(pool.clone())
        .check(pool, &Resource::new("bad:checked").unwrap(), tok(5))
        .await
        .unwrap();

    // A Redis of its own: the snapshots compare every key, and the other tests of this binary
    // write to the shared one meanwhile.
    let redis_server = pgfence_testkit::Server::redis().await.unwrap();
    let redis_url = redis_server.url();
    let issuer = RedisIssuer::connect(&redis_url).await.unwrap();
    let mut redis = redis::Client::open(redis_url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    // Redis fixtures: a counter at the top of the range, a corrupted counter, a held lock.
    let at_max = Resource::new("bad:at-max").unwrap();
    let corrupt = Resource::new("bad:corrupt").unwrap();
    // Unique, so that a rerun within the lease's 600 s on a shared Redis finds it free.
    let held = support::unique_resource("bad:held");
    let _: () = redis
        .set(counter_key(&at_max), i64::MAX.to_string())
        .await
        .unwrap();
    let _: () = redis.set(counter_key(&corrupt), "twelve").await.unwrap();
    let mut held_lease = issuer
        .acquire(&held, Duration::from_secs(600))
        .await
        .unwrap()
        .unwrap();
    let fresh = Resource::new("bad:fresh").unwrap();

    let ten_kb = "x".repeat(10 * 1024);
    let inject_url = format!("{redis_url}/0\r\nFLUSHALL");
    let pg_base = support::pg_url().await;
    let missing_db_url = format!(
        "{}/no_such_database_{}",
        pg_base.rsplit_once('/').unwrap().0,
        std::process::id()
    );
    let (i, p, held_lease) = (&issuer, pool, &mut held_lease);
    let mut cases: Vec<Case<'_>> = Vec::new();

    // --- identifiers -----------------------------------------------------------------------
    case!(
        cases,
        "table name with `; DROP TABLE`",
        async {
            pgfence::guard::guard(
                p,
                &TableName::new("public", "victim; DROP TABLE victim; --")?,
            )
            .await
            .map(drop)
        },
        Error::TableNotFound(_)
    );
    case!(
        cases,
        "table name breaking out of its quotes",
        async {
            pgfence::guard::guard(
                p,
                &TableName::new("public", "victim\"; DROP TABLE victim; --")?,
            )
            .await
            .map(drop)
        },
        Error::TableNotFound(_)
    );
    case!(
        cases,
        "CLI form with a stray quote",
        async { TableName::parse("victim\"; DROP TABLE victim; --").map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Identifier { .. })
    );
    case!(
        cases,
        "table name with an SQL comment",
        async {
            pgfence::guard::guard(p, &TableName::new("public", "victim/**/--")?)
                .await
                .map(drop)
        },
        Error::TableNotFound(_)
    );
    case!(
        cases,
        "schema name with an injected statement",
        async {
            pgfence::guard::guard(
                p,
                &TableName::new("public; DROP SCHEMA public CASCADE; --", "victim")?,
            )
            .await
            .map(drop)
        },
        Error::TableNotFound(_)
    );
    case!(
        cases,
        "unicode homoglyph of an existing table (Cyrillic i)",
        async {
            pgfence::guard::guard(p, &TableName::new("public", "v\u{0456}ctim")?)
                .await
                .map(drop)
        },
        Error::TableNotFound(_)
    );
    case!(
        cases,
        "right-to-left override in a table name",
        async {
            pgfence::guard::guard(p, &TableName::new("public", "victim\u{202e}")?)
                .await
                .map(drop)
        },
        Error::TableNotFound(_)
    );
    case!(
        cases,
        "identifier of 64 ASCII bytes (Postgres would truncate)",
        async { TableName::new("public", &"v".repeat(64)).map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Identifier { .. })
    );
    case!(
        cases,
        "identifier of 32 two-byte characters (64 bytes)",
        async { TableName::new("public", &"é".repeat(32)).map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Identifier { .. })
    );
    case!(
        cases,
        "empty identifier",
        async { TableName::new("", "victim").map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Identifier { .. })
    );
    case!(
        cases,
        "NUL byte in an identifier",
        async { TableName::new("public", "vic\0tim").map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Identifier { .. })
    );
    case!(
        cases,
        "three-part table name",
        async { TableName::parse("db.public.victim").map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Identifier { .. })
    );
    case!(
        cases,
        "unterminated quoted identifier",
        async { TableName::parse("\"victim").map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Identifier { .. })
    );
    case!(
        cases,
        "guard a view",
        async {
            pgfence::guard::guard(p, &TableName::parse("victim_view")?)
                .await
                .map(drop)
        },
        Error::TableNotFound(_)
    );
    case!(
        cases,
        "guard a system catalog",
        async {
            pgfence::guard::guard(p, &TableName::parse("pg_catalog.pg_class")?)
                .await
                .map(drop)
        },
        Error::Invalid(pgfence::error::InvalidInput::Table { .. })
    );
    case!(cases, "guard a table whose fence column is text",
        async { pgfence::guard::guard(p, &TableName::parse("textfence")?).await.map(drop) },
        Error::FenceColumnType { found, .. } if found == "text");
    case!(
        cases,
        "guard a table that does not exist",
        async {
            pgfence::guard::guard(p, &TableName::parse("nope")?)
                .await
                .map(drop)
        },
        Error::TableNotFound(_)
    );
    case!(
        cases,
        "unguard a table that does not exist",
        async {
            pgfence::guard::unguard(p, &TableName::parse("nope")?, true)
                .await
                .map(drop)
        },
        Error::TableNotFound(_)
    );

    // --- repository declarations -------------------------------------------------------------
    case!(
        cases,
        "fenced update of a table that does not exist",
        async { repo::<Ghost>(p)?.update(p, tok(9), &Ghost).await },
        Error::TableNotFound(_)
    );
    case!(
        cases,
        "column name that closes its quotes and sets another column",
        async {
            repo::<HostileColumn>(p)?
                .update(p, tok(9), &HostileColumn)
                .await
        },
        Error::Backend(b) if b.kind() == pgfence::error::BackendKind::Database
    );
    case!(
        cases,
        "column name with an SQL comment",
        async {
            repo::<CommentColumn>(p)?
                .update(p, tok(9), &CommentColumn)
                .await
        },
        Error::Backend(b) if b.kind() == pgfence::error::BackendKind::Database
    );
    case!(
        cases,
        "hostile table name in a declaration",
        async {
            repo::<HostileTable>(p)?
                .update(p, tok(9), &HostileTable)
                .await
        },
        Error::TableNotFound(_)
    );
    case!(
        cases,
        "declaration that writes `fence` itself",
        async { repo::<DeclaresFence>(p).map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Table { .. })
    );
    case!(
        cases,
        "declaration without key columns",
        async { repo::<NoKey>(p).map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Table { .. })
    );
    case!(
        cases,
        "declaration with a duplicated column",
        async { repo::<DuplicateColumn>(p).map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Table { .. })
    );
    case!(
        cases,
        "declaration with an overlong column name",
        async { repo::<OverlongColumn>(p).map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Identifier { .. })
    );

    // --- tokens --------------------------------------------------------------------------------
    case!(
        cases,
        "token 0",
        async { FenceToken::new(0).map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Token(v)) if *v == "0"
    );
    case!(
        cases,
        "token -1",
        async { FenceToken::new(-1).map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Token(v)) if *v == "-1"
    );
    case!(cases, "token i64::MIN",
        async { FenceToken::new(i64::MIN).map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Token(v)) if *v == i64::MIN.to_string());
    case!(cases, "FenceToken::from_u64(u64::MAX)",
        async { FenceToken::from_u64(u64::MAX).map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Token(v)) if *v == u64::MAX.to_string());
    case!(
        cases,
        "FenceToken::from_u64(0)",
        async { FenceToken::from_u64(0).map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Token(v)) if *v == "0"
    );
    case!(
        cases,
        "\"9223372036854775808\" (i64::MAX + 1)",
        async { "9223372036854775808".parse::<FenceToken>().map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Token(v)) if v.contains("9223372036854775808")
    );
    case!(
        cases,
        "\"-0\"",
        async { "-0".parse::<FenceToken>().map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Token(v)) if *v == "0"
    );
    case!(
        cases,
        "token text beyond i128",
        async { "1".repeat(60).parse::<FenceToken>().map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Token(_))
    );
    case!(
        cases,
        "token in exponent notation",
        async { "1e3".parse::<FenceToken>().map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Token(_))
    );
    case!(
        cases,
        "token in full-width digits",
        async { "１２".parse::<FenceToken>().map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Token(_))
    );
    case!(cases, "pgfence.check(token 0) in raw SQL",
        async { sqlx::query("SELECT pgfence.check('bad:checked', 0)").execute(p).await.map(drop).map_err(Error::from) },
        Error::Backend(b) if b.sqlstate() == Some("22023"));
    case!(cases, "pgfence.check(token -5) in raw SQL",
        async { sqlx::query("SELECT pgfence.check('bad:checked', -5)").execute(p).await.map(drop).map_err(Error::from) },
        Error::Backend(b) if b.sqlstate() == Some("22023"));
    case!(cases, "pgfence.check(NULL token) in raw SQL",
        async { sqlx::query("SELECT pgfence.check('bad:checked', NULL)").execute(p).await.map(drop).map_err(Error::from) },
        Error::Backend(b) if b.sqlstate() == Some("22023"));
    case!(cases, "pgfence.check with a 10 KB resource in raw SQL",
        async { sqlx::query("SELECT pgfence.check($1, 6)").bind(&ten_kb).execute(p).await.map(drop).map_err(Error::from) },
        Error::Backend(b) if b.sqlstate() == Some("22023"));
    case!(
        cases,
        "raw UPDATE lowering a guarded row's fence",
        async {
            sqlx::query(AssertSqlSafe(lower_to_4.clone()))
                .execute(p)
                .await
                .map(drop)
                .map_err(Error::from)
        },
        Error::StaleToken {
            presented: 4,
            current: 5,
            ..
        }
    );
    case!(
        cases,
        "raw UPDATE that leaves the fence alone",
        async {
            sqlx::query("UPDATE acct SET balance = 0 WHERE id = 1")
                .execute(p)
                .await
                .map(drop)
                .map_err(Error::from)
        },
        // A write that does not advance the fence is lease-less (PF007), whatever the fence.
        Error::LeaselessWrite { .. }
    );
    case!(
        cases,
        "raw UPDATE setting the fence to -1",
        async {
            sqlx::query("UPDATE acct SET balance = 0, fence = -1 WHERE id = 1")
                .execute(p)
                .await
                .map(drop)
                .map_err(Error::from)
        },
        Error::StaleToken {
            presented: -1,
            current: 5,
            ..
        }
    );
    case!(cases, "raw UPDATE setting the fence to NULL",
        async { sqlx::query("UPDATE acct SET balance = 0, fence = NULL WHERE id = 1").execute(p).await.map(drop).map_err(Error::from) },
        Error::Backend(b) if b.sqlstate() == Some("23502"));

    // --- resource names ------------------------------------------------------------------------
    case!(
        cases,
        "resource with a brace (breaks the hash tag)",
        async { Resource::new("a{b").map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Resource(_))
    );
    case!(
        cases,
        "resource with a closing brace",
        async { Resource::new("tenant}:x").map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Resource(_))
    );
    case!(
        cases,
        "resource with a newline",
        async { Resource::new("a\nSET pgfence:{a}:fence 0").map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Resource(_))
    );
    case!(
        cases,
        "resource with a NUL",
        async { Resource::new("a\0b").map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Resource(_))
    );
    case!(
        cases,
        "resource of 10 KB",
        async { Resource::new(ten_kb.clone()).map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Resource(_))
    );
    case!(
        cases,
        "empty resource",
        async { Resource::new("").map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Resource(_))
    );
    case!(
        cases,
        "resource with a tab",
        async { Resource::new("a\tb").map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Resource(_))
    );
    case!(
        cases,
        "resource with DEL (0x7f)",
        async { Resource::new("a\u{7f}").map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Resource(_))
    );
    case!(
        cases,
        "resource with a no-break space",
        async { Resource::new("a\u{a0}b").map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Resource(_))
    );

    // --- TTLs and lock operations --------------------------------------------------------------
    case!(
        cases,
        "acquire with TTL 0",
        async { i.acquire(&fresh, Duration::ZERO).await.map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Duration(_))
    );
    case!(
        cases,
        "acquire with TTL 9 ms",
        async { i.acquire(&fresh, Duration::from_millis(9)).await.map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Duration(_))
    );
    case!(
        cases,
        "acquire with a one-year TTL",
        async {
            i.acquire(&fresh, Duration::from_secs(365 * 24 * 3600))
                .await
                .map(drop)
        },
        Error::Invalid(pgfence::error::InvalidInput::Duration(_))
    );
    case!(
        cases,
        "acquire with TTL Duration::MAX",
        async { i.acquire(&fresh, Duration::MAX).await.map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Duration(_))
    );
    case!(
        cases,
        "acquire_wait with TTL 1 ns",
        async {
            i.acquire_wait(&fresh, Duration::from_nanos(1), Duration::from_secs(1))
                .await
                .map(drop)
        },
        Error::Invalid(pgfence::error::InvalidInput::Duration(_))
    );
    case!(
        cases,
        "extend a held lock to TTL 0",
        async { i.extend(held_lease, Duration::ZERO).await.map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Duration(_))
    );
    case!(
        cases,
        "owner id containing ':'",
        async {
            i.acquire_as(&fresh, "me:1", Duration::from_secs(1))
                .await
                .map(drop)
        },
        Error::Invalid(pgfence::error::InvalidInput::Owner(_))
    );
    case!(
        cases,
        "empty owner id",
        async {
            i.acquire_as(&fresh, "", Duration::from_secs(1))
                .await
                .map(drop)
        },
        Error::Invalid(pgfence::error::InvalidInput::Owner(_))
    );
    case!(
        cases,
        "raise the counter floor to -1",
        async { i.raise_floor(&fresh, -1).await.map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Token(v)) if *v == "-1"
    );
    case!(
        cases,
        "acquire when the counter is at i64::MAX (past the token limit)",
        async { i.acquire(&at_max, Duration::from_secs(5)).await.map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::Token(_))
    );
    case!(
        cases,
        "acquire when the counter is not a number",
        async { i.acquire(&corrupt, Duration::from_secs(5)).await.map(drop) },
        Error::Backend(b) if b.kind() == pgfence::error::BackendKind::Redis
    );

    // --- connection strings --------------------------------------------------------------------
    case!(
        cases,
        "RedisIssuer::connect(\"not a url\")",
        async { RedisIssuer::connect("not a url").await.map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::IssuerUrl(_))
    );
    case!(
        cases,
        "RedisIssuer::connect(\"\")",
        async { RedisIssuer::connect("").await.map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::IssuerUrl(_))
    );
    case!(
        cases,
        "Redis URL with port 99999",
        async {
            RedisIssuer::connect("redis://127.0.0.1:99999")
                .await
                .map(drop)
        },
        Error::Invalid(pgfence::error::InvalidInput::IssuerUrl(_))
    );
    case!(
        cases,
        "Redis URL of a closed port",
        async { RedisIssuer::connect("redis://127.0.0.1:1").await.map(drop) },
        Error::Backend(b) if b.kind() == pgfence::error::BackendKind::Redis
    );
    case!(
        cases,
        "Redis URL with a newline and a command in the database number",
        async { RedisIssuer::connect(&inject_url).await.map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::IssuerUrl(_))
    );
    case!(
        cases,
        "Redis cluster with no nodes",
        async { RedisIssuer::connect_cluster(&[]).await.map(drop) },
        Error::Invalid(pgfence::error::InvalidInput::IssuerUrl(_))
    );
    case!(
        cases,
        "Postgres URL \"not a url\"",
        pg_connect("not a url"),
        Error::Backend(b) if b.kind() == pgfence::error::BackendKind::Database
    );
    case!(
        cases,
        "Postgres URL with another scheme",
        pg_connect("mysql://root@127.0.0.1/x"),
        Error::Backend(b) if b.kind() == pgfence::error::BackendKind::Database
    );
    case!(
        cases,
        "Postgres URL with port 99999",
        pg_connect("postgres://postgres@127.0.0.1:99999/x"),
        Error::Backend(b) if b.kind() == pgfence::error::BackendKind::Database
    );
    case!(
        cases,
        "Postgres URL of a closed port",
        pg_connect("postgres://postgres@127.0.0.1:1/x"),
        Error::Backend(b) if b.kind() == pgfence::error::BackendKind::Database
    );
    case!(cases, "Postgres URL of a database that does not exist",
        pg_connect(&missing_db_url),
        Error::Backend(b) if b.sqlstate() == Some("3D000"));

    let mut failures = Vec::new();
    let total = cases.len();
    for case in cases {
        let pg_before = pg_snapshot(p).await;
        let redis_before = redis_snapshot(&mut redis).await;
        let outcome = case.run.await;
        let pg_after = pg_snapshot(p).await;
        let redis_after = redis_snapshot(&mut redis).await;
        match &outcome {
            Ok(()) => failures.push(format!("{}: accepted", case.name)),
            Err(e) if !(case.expect)(e) => {
                failures.push(format!("{}: unexpected error {e:?}", case.name));
            }
            Err(e) => eprintln!("ok  {:<60} {e}", case.name),
        }
        if pg_before != pg_after {
            failures.push(format!(
                "{}: Postgres changed\n before {pg_before:#?}\n after {pg_after:#?}",
                case.name
            ));
        }
        if redis_before != redis_after {
            failures.push(format!(
                "{}: Redis changed\n before {redis_before:#?}\n after {redis_after:#?}",
                case.name
            ));
        }
    }
    assert!(total >= 30, "the catalogue has {total} cases");
    assert!(
        failures.is_empty(),
        "{} of {total} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );

    // The fixtures are intact: the victim row, the counter at the top, no lock next to it.
    let v: String = sqlx::query_scalar("SELECT v FROM victim WHERE id = 1")
        .fetch_one(p)
        .await
        .unwrap();
    assert_eq!(v, "original");
    let lock: Option<String> = redis.get(lock_key(&at_max)).await.unwrap();
    assert_eq!(lock, None, "a failed acquire leaves no lock behind");
    let row = sqlx::query("SELECT balance, fence FROM acct WHERE id = 1")
        .fetch_one(p)
        .await
        .unwrap();
    assert_eq!(
        (row.get::<i64, _>("balance"), row.get::<i64, _>("fence")),
        (90, fence_5)
    );
}

/// A corrupted, non-positive counter must be refused without being changed (`acquire.lua`
/// validates the counter before `INCR`).
#[tokio::test]
async fn non_positive_counter_is_refused_without_being_changed() {
    let issuer = support::issuer().await;
    let mut redis = redis::Client::open(redis_url().await.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let resource = support::unique_resource("negative");
    let _: () = redis.set(counter_key(&resource), "-1").await.unwrap();
    let err = issuer
        .acquire(&resource, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Backend(b) if b.kind() == pgfence::error::BackendKind::Redis),
        "{err:?}"
    );
    let counter: String = redis.get(counter_key(&resource)).await.unwrap();
    let lock: Option<String> = redis.get(lock_key(&resource)).await.unwrap();
    assert_eq!(
        (counter.as_str(), lock),
        ("-1", None),
        "the refused acquire changed the counter"
    );
}

/// pgfence's own tables (and the catalogs) are not user tables: guarding them is refused with
/// a typed error and changes nothing.
#[tokio::test]
async fn guarding_pgfence_own_tables_is_refused() {
    let db = TestDb::new().await;
    for table in [
        "pgfence.audit",
        "pgfence.resource_fence",
        "pgfence.tombstone",
        "pg_catalog.pg_class",
        "information_schema.sql_features",
    ] {
        let before = pg_snapshot(&db.pool).await;
        let outcome = pgfence::guard::guard(&db.pool, &TableName::parse(table).unwrap()).await;
        let after = pg_snapshot(&db.pool).await;
        assert!(
            matches!(
                outcome,
                Err(Error::Invalid(pgfence::error::InvalidInput::Table { .. }))
            ),
            "{table}: {outcome:?}"
        );
        assert_eq!(before, after, "{table}");
    }
}

/// The same promise from the command line: each malformed invocation fails with a non-zero
/// exit and one line on stderr, and Postgres and Redis are unchanged. Runs against its own
/// Redis so that the snapshot can include every key.
#[tokio::test]
async fn hostile_cli_inputs_fail_cleanly_and_change_nothing() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE victim (id int PRIMARY KEY, v text NOT NULL);
         INSERT INTO victim VALUES (1, 'original');
         CREATE TABLE textfence (id int PRIMARY KEY, fence text);",
    )
    .await;
    let redis_server = pgfence_testkit::Server::redis().await.unwrap();
    let mut redis = redis::Client::open(redis_server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis.set("pgfence:{cli}:fence", "7").await.unwrap();
    let db_url = db.url();
    let long = "x".repeat(64);
    let big = "r".repeat(10_000);
    let cases: Vec<Vec<&str>> = vec![
        vec!["guard", "no_such_table"],
        vec!["guard", "victim; DROP TABLE victim; --"],
        vec!["guard", "\"victim\"\"; DROP TABLE victim; --\""],
        vec!["guard", "victim' OR '1'='1"],
        vec!["guard", "textfence"],
        vec!["guard", "pgfence.audit"],
        vec!["guard", "pg_catalog.pg_class"],
        vec!["guard", &long],
        vec!["guard", "a.b.c"],
        vec!["guard", "\"unterminated"],
        vec!["unguard", "no_such_table"],
        vec!["lock", "acquire", "cli{tag}", "--ttl", "1s"],
        vec!["lock", "acquire", "new\nline", "--ttl", "1s"],
        vec!["lock", "acquire", &big, "--ttl", "1s"],
        vec!["lock", "acquire", "cli", "--ttl", "0ms"],
        vec!["lock", "acquire", "cli", "--ttl", "400d"],
        vec!["lock", "acquire", "cli", "--ttl", "-1s"],
        vec!["lock", "acquire", "cli", "--ttl", "1 year"],
        vec!["lock", "release", "cli", "--owner", "x", "--token", "0"],
        vec![
            "lock",
            "release",
            "cli",
            "--owner",
            "x",
            "--token",
            "9223372036854775808",
        ],
        vec!["reseed", "cli", "--floor", "-5"],
        vec!["run", "--resource", "cli", "--ttl", "0s", "--", "true"],
        vec!["run", "--resource", "cli{x}", "--ttl", "1s", "--", "true"],
        vec!["audit", "--since", "last tuesday"],
        vec!["audit", "--limit", "0"],
        vec!["audit", "prune", "--older-than", "forever"],
        vec!["--database-url", "not a url", "migrate"],
        vec![
            "--database-url",
            "postgres://nobody@127.0.0.1:1/none",
            "guard",
            "victim",
        ],
        vec![
            "--redis-url",
            "redis://127.0.0.1:1",
            "lock",
            "status",
            "cli",
        ],
        vec![
            "--redis-url",
            "gopher://x",
            "lock",
            "acquire",
            "cli",
            "--ttl",
            "1s",
        ],
    ];
    assert!(cases.len() >= 30);
    let mut failures = Vec::new();
    for args in &cases {
        let pg_before = pg_snapshot(&db.pool).await;
        let redis_before = redis_snapshot(&mut redis).await;
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_pgfence"))
            .args(args)
            .env("DATABASE_URL", &db_url)
            .env("REDIS_URL", redis_server.url())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        if out.status.success() {
            failures.push(format!("{args:?}: succeeded"));
        }
        if !stderr.starts_with("pgfence: ") || stderr.trim_end().lines().count() != 1 {
            failures.push(format!("{args:?}: not one clear line: {stderr:?}"));
        }
        if pg_snapshot(&db.pool).await != pg_before {
            failures.push(format!("{args:?}: Postgres changed"));
        }
        if redis_snapshot(&mut redis).await != redis_before {
            failures.push(format!("{args:?}: Redis changed"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test]
async fn malformed_input_and_unreachable_servers_fail_cleanly() {
    let db = TestDb::new().await;
    let cli = Cli::new(&db).await;
    // Durations and names: clap or pgfence reject them before any connection.
    for args in [
        &["lock", "acquire", "r", "--ttl", "10 years"][..],
        &["lock", "acquire", "r", "--ttl", "-5s"],
        &["run", "--resource", "r", "--ttl", "1.5s", "--", "true"],
        &["audit", "prune", "--older-than", "soon"],
    ] {
        let out = cli.run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(
            err.starts_with("pgfence: invalid value") && err.contains("invalid duration"),
            "{args:?}: {err}"
        );
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    }
    assert!(
        cli.fails(&["lock", "acquire", "r", "--ttl", "0s"])
            .contains("TTL")
    );
    assert!(
        cli.fails(&["lock", "acquire", "r", "--ttl", "400d"])
            .contains("TTL")
    );
    assert!(
        cli.fails(&["lock", "acquire", "bad{name}", "--ttl", "1s"])
            .contains("bad resource name")
    );
    assert!(
        cli.fails(&["lock", "acquire", "has space", "--ttl", "1s"])
            .contains("bad resource name")
    );
    assert!(
        cli.fails(&["lock", "release", "r", "--owner", "x", "--token", "0"])
            .contains("bad token")
    );

    let unreachable = |pg: &str, redis: &str, args: &[&str]| {
        let out = Command::new(BIN)
            .args(args)
            .env("DATABASE_URL", pg)
            .env("REDIS_URL", redis)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        err
    };
    assert!(
        unreachable("postgres://postgres@127.0.0.1:1/x", "", &["migrate"])
            .contains("cannot connect to PostgreSQL")
    );
    assert!(unreachable("not a url", "", &["migrate"]).contains("cannot connect to PostgreSQL"));
    assert!(
        unreachable("", "redis://127.0.0.1:1", &["lock", "status", "r"])
            .contains("cannot connect to Redis")
    );
    // Not a Redis URL: not called one (issue 19); refused as an issuer URL.
    let err = unreachable("", "nope://x", &["lock", "status", "r"]);
    assert!(
        err.contains("invalid issuer URL") && !err.contains("Redis"),
        "{err}"
    );
    assert!(unreachable("postgres://u:hunter2@127.0.0.1:1/x", "", &["migrate"]).contains("u:***@"));
    let out = Command::new(BIN)
        .args(["migrate"])
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("no PostgreSQL URL"));
}
