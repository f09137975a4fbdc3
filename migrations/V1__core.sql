-- pgfence core schema. Everything lives in the `pgfence` schema; the runner creates the schema
-- itself (under its advisory lock) before refinery's history table is asserted in it.
--
-- Every function pins search_path so that objects a user creates in `public` (or anywhere
-- else on the caller's path) can never be picked up instead of the catalog's.

-- Highest token seen per resource, raised by pgfence.check().
CREATE TABLE pgfence.resource_fence (
    resource   text        PRIMARY KEY CHECK (length(resource) BETWEEN 1 AND 200),
    fence      bigint      NOT NULL CHECK (fence > 0),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Rows deleted by a fenced delete: a stale holder's upsert must not bring them back.
CREATE TABLE pgfence.tombstone (
    rel        oid         NOT NULL,
    row_key    text        NOT NULL,
    fence      bigint      NOT NULL CHECK (fence > 0),
    deleted_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (rel, row_key)
);

-- Rejected writes. Written outside the caller's transaction, so it survives rollbacks.
CREATE TABLE pgfence.audit (
    id         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    resource   text,
    table_name text,
    row_key    text,
    presented  bigint      NOT NULL,
    current    bigint,
    holder     text,
    operation  text        NOT NULL
);
CREATE INDEX audit_at_idx ON pgfence.audit (at);
CREATE INDEX audit_resource_at_idx ON pgfence.audit (resource, at);

-- BEFORE UPDATE trigger body. The trigger is created with
-- `WHEN (NEW.fence <= OLD.fence)`, so this only runs for a write that does not advance the
-- fence; the hot path pays for one integer comparison, not a PL/pgSQL call.
CREATE FUNCTION pgfence.reject_stale_update() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'pgfence: stale fence token on %.%: presented %, current %',
            quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME), NEW.fence, OLD.fence
        USING ERRCODE = 'PF001',
              DETAIL = format('presented=%s current=%s target=%s.%s',
                              NEW.fence, OLD.fence,
                              quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME)),
              HINT = 'every UPDATE of a guarded table must set fence to a token newer than the row''s',
              SCHEMA = TG_TABLE_SCHEMA,
              TABLE = TG_TABLE_NAME,
              COLUMN = 'fence';
END
$$;

-- Resolves schema + table names (as stored, no parsing) to a table, or raises 42P01.
CREATE FUNCTION pgfence.resolve_table(p_schema text, p_table text) RETURNS regclass
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    rel oid;
BEGIN
    SELECT c.oid INTO rel
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE n.nspname = p_schema AND c.relname = p_table AND c.relkind IN ('r', 'p');
    IF rel IS NULL THEN
        RAISE EXCEPTION 'pgfence: table %.% does not exist', quote_ident(p_schema), quote_ident(p_table)
            USING ERRCODE = '42P01', SCHEMA = p_schema, TABLE = format('%I.%I', p_schema, p_table);
    END IF;
    RETURN rel::regclass;
END
$$;

-- Guards a table: adds `fence bigint NOT NULL DEFAULT 0` if missing (metadata-only on
-- PostgreSQL 11+), refuses a `fence` column of another type, installs the trigger.
-- Returns true when something changed, false when the table was already guarded.
CREATE FUNCTION pgfence.guard(p_schema text, p_table text) RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_rel regclass := pgfence.resolve_table(p_schema, p_table);
    col_type text;
    col_notnull boolean;
    changed boolean := false;
BEGIN
    -- Self-conflicting lock: concurrent guards of one table run one after the other.
    EXECUTE format('LOCK TABLE %s IN SHARE ROW EXCLUSIVE MODE', v_rel);

    SELECT format_type(a.atttypid, a.atttypmod), a.attnotnull INTO col_type, col_notnull
      FROM pg_attribute a
     WHERE a.attrelid = v_rel AND a.attname = 'fence' AND NOT a.attisdropped;

    IF col_type IS NULL THEN
        EXECUTE format('ALTER TABLE %s ADD COLUMN fence bigint NOT NULL DEFAULT 0', v_rel);
        changed := true;
    ELSIF col_type <> 'bigint' THEN
        RAISE EXCEPTION 'pgfence: %.fence has type %, expected bigint', v_rel, col_type
            USING ERRCODE = 'PF002', DETAIL = col_type, SCHEMA = p_schema, TABLE = v_rel::text;
    ELSIF NOT col_notnull THEN
        EXECUTE format('UPDATE %s SET fence = 0 WHERE fence IS NULL', v_rel);
        EXECUTE format('ALTER TABLE %s ALTER COLUMN fence SET DEFAULT 0, ALTER COLUMN fence SET NOT NULL', v_rel);
        changed := true;
    END IF;

    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = v_rel AND tgname = 'pgfence_guard') THEN
        EXECUTE format(
            'CREATE TRIGGER pgfence_guard BEFORE UPDATE ON %s FOR EACH ROW '
            'WHEN (NEW.fence OPERATOR(pg_catalog.<=) OLD.fence) '
            'EXECUTE FUNCTION pgfence.reject_stale_update()', v_rel);
        changed := true;
    END IF;
    RETURN changed;
END
$$;

-- Removes the trigger (and, if asked, the fence column). Returns true when something changed.
CREATE FUNCTION pgfence.unguard(p_schema text, p_table text, p_drop_column boolean DEFAULT false)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_rel regclass := pgfence.resolve_table(p_schema, p_table);
    changed boolean := false;
BEGIN
    EXECUTE format('LOCK TABLE %s IN SHARE ROW EXCLUSIVE MODE', v_rel);
    IF EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = v_rel AND tgname = 'pgfence_guard') THEN
        EXECUTE format('DROP TRIGGER pgfence_guard ON %s', v_rel);
        changed := true;
    END IF;
    IF p_drop_column AND EXISTS (SELECT 1 FROM pg_attribute
                                  WHERE attrelid = v_rel AND attname = 'fence' AND NOT attisdropped) THEN
        EXECUTE format('ALTER TABLE %s DROP COLUMN fence', v_rel);
        changed := true;
    END IF;
    DELETE FROM pgfence.tombstone t WHERE t.rel = v_rel::oid;
    RETURN changed;
END
$$;

-- Guarded tables, for status displays.
CREATE VIEW pgfence.guarded_tables AS
SELECT n.nspname::text AS schema_name, c.relname::text AS table_name
  FROM pg_trigger t
  JOIN pg_class c ON c.oid = t.tgrelid
  JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE t.tgname = 'pgfence_guard' AND NOT t.tgisinternal;

-- The transaction-scope check: atomically raises the resource's high-water mark to p_token,
-- or raises PF001 if p_token is not newer. The row lock it takes is held until the caller's
-- transaction ends, so holders of one resource are serialised: a holder with an older token
-- cannot commit work after a newer one has checked.
CREATE FUNCTION pgfence.check(p_resource text, p_token bigint) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cur bigint;
BEGIN
    IF p_token IS NULL OR p_token <= 0 THEN
        RAISE EXCEPTION 'pgfence: fence tokens are positive, got %', p_token USING ERRCODE = '22023';
    END IF;
    IF p_resource IS NULL OR length(p_resource) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'pgfence: resource names are 1 to 200 characters' USING ERRCODE = '22023';
    END IF;

    INSERT INTO pgfence.resource_fence AS r (resource, fence)
    VALUES (p_resource, p_token)
    ON CONFLICT (resource) DO UPDATE
        SET fence = EXCLUDED.fence, updated_at = now()
        WHERE r.fence < EXCLUDED.fence;
    IF FOUND THEN
        RETURN;
    END IF;

    -- ON CONFLICT left the row locked; read the mark that beat us.
    SELECT r.fence INTO cur FROM pgfence.resource_fence r WHERE r.resource = p_resource;
    RAISE EXCEPTION 'pgfence: stale fence token for resource %: presented %, current %',
            p_resource, p_token, cur
        USING ERRCODE = 'PF001',
              DETAIL = format('presented=%s current=%s target=%s', p_token, cur, p_resource);
END
$$;

-- Highest token recorded for a resource (0 when none).
CREATE FUNCTION pgfence.high_water(p_resource text) RETURNS bigint
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT coalesce((SELECT fence FROM pgfence.resource_fence WHERE resource = p_resource), 0)
$$;
