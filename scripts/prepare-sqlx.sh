#!/usr/bin/env bash
# Regenerates .sqlx/ (sqlx's offline query metadata) after a query! or migration change.
# Needs a running PostgreSQL: ADMIN_URL (default postgres://postgres@127.0.0.1/postgres).
# Creates a scratch database, applies pgfence's migrations with psql, and re-expands the
# query macros with SQLX_OFFLINE_DIR set (pgfence's macros read PGFENCE_DATABASE_URL: see sqlx.toml), which makes sqlx write one JSON file per query.
set -euo pipefail
cd "$(dirname "$0")/.."
admin=${ADMIN_URL:-postgres://postgres@127.0.0.1/postgres}
db=pgfence_sqlx_prepare
psql "$admin" -qc "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db"
url=${admin%/*}/$db
{ echo 'CREATE SCHEMA pgfence;'; cat migrations/V*.sql; } | psql "$url" -q -v ON_ERROR_STOP=1
rm -rf .sqlx && mkdir .sqlx
touch src/lib.rs
SQLX_OFFLINE=false SQLX_OFFLINE_DIR="$PWD/.sqlx" PGFENCE_DATABASE_URL="$url" cargo check -p pgfence --lib --quiet
psql "$admin" -qc "DROP DATABASE $db"
ls .sqlx | wc -l
