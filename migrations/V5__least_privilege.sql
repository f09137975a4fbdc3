-- Least privilege. An application role gets EXECUTE on the functions it calls and, on
-- pgfence's tables, exactly what the library's own statements need (see pgfence::grant_sql):
-- it can raise marks but never lower them, append audit rows but never change or delete
-- them, and it cannot guard or unguard. Everything below is owned by the role that runs
-- pgfence's migrations.
--
-- * Functions that read or write pgfence's tables on an application's behalf run with their
--   owner's rights (SECURITY DEFINER). Each pins search_path (pg_catalog, pg_temp: temporary
--   objects last, never searched for functions or operators) and runs only static SQL: no
--   argument ever becomes SQL text.
-- * Nothing is usable by PUBLIC any more (record_rejection, an invoker-rights wrapper, is
--   the one function PUBLIC may execute, and the schema itself needs a grant):
--   pgfence::grant (`pgfence grant ROLE`) grants an application role what it needs; guard,
--   unguard and unpoison_resource stay with the owner (and superusers).

-- The transaction-scope check and the high-water marks: the only ways an application
-- touches pgfence.resource_fence. check only ever raises a mark.
ALTER FUNCTION pgfence.check(text, bigint, integer) SECURITY DEFINER;
ALTER FUNCTION pgfence.high_water(text) SECURITY DEFINER;
ALTER FUNCTION pgfence.domain_high_water(text) SECURITY DEFINER;
-- Appends one audit row, with the owner's rights: the one way record_rejection and try_check
-- write pgfence.audit. It cannot change or delete a row.
CREATE FUNCTION pgfence.append_audit(
    p_resource text,
    p_table text,
    p_key text,
    p_presented bigint,
    p_current bigint,
    p_holder text,
    p_operation text,
    p_other_counter boolean
) RETURNS void
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO pgfence.audit (resource, table_name, row_key, presented, current, holder, operation,
                               other_counter)
    VALUES (p_resource, p_table, p_key, p_presented, p_current, p_holder, p_operation,
            coalesce(p_other_counter, false))
$$;

-- The repository calls this from a rejected write's explaining statement. It stays with the
-- caller's rights and executable by PUBLIC (who still needs USAGE on the schema): for a role
-- that was not granted append_audit, the permission error is then raised inside this
-- function, where the library recognises an audit failure, reports it, and still returns the
-- StaleToken (a denied call of this function itself would hide the rejection).
CREATE OR REPLACE FUNCTION pgfence.record_rejection(
    p_resource text,
    p_table text,
    p_key text,
    p_presented bigint,
    p_current bigint,
    p_holder text,
    p_operation text,
    p_lock_timeout_ms integer,
    p_other_counter boolean
) RETURNS text
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- Bounds the wait for the audit table. Local to the calling statement's transaction,
    -- which is that statement alone.
    PERFORM pg_catalog.set_config('lock_timeout', p_lock_timeout_ms::pg_catalog.text, true);
    PERFORM pgfence.append_audit(p_resource, p_table, p_key, p_presented, p_current, p_holder,
                                 p_operation, p_other_counter);
    RETURN '';
END
$$;

-- The database role that wrote each audit row (the login role: session_user, which neither
-- SECURITY DEFINER nor SET ROLE changes), next to the holder the writer claims. Rows written
-- before this migration have NULL. Application roles cannot write this column.
ALTER TABLE pgfence.audit ADD COLUMN db_user text;
ALTER TABLE pgfence.audit ALTER COLUMN db_user SET DEFAULT session_user;

-- Tombstones (fenced deletes) are written by the repository's own statements, so application
-- roles get INSERT and UPDATE (fence, deleted_at) on them; this trigger keeps a tombstone's
-- fence from going down, whoever writes it (the library's upsert only ever raises it).
CREATE FUNCTION pgfence.reject_lowered_tombstone() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'pgfence: a tombstone''s fence never goes down (presented token %, current token %)',
            NEW.fence >> 24, OLD.fence >> 24
        USING ERRCODE = '42501',
              DETAIL = format('presented=%s current=%s table=pgfence.tombstone',
                              NEW.fence >> 24, OLD.fence >> 24),
              HINT = 'the table owner can delete a tombstone',
              SCHEMA = 'pgfence',
              TABLE = 'tombstone',
              COLUMN = 'fence';
END
$$;
CREATE TRIGGER pgfence_tombstone_never_lowers BEFORE UPDATE ON pgfence.tombstone FOR EACH ROW
    WHEN (NEW.fence OPERATOR(pg_catalog.<) OLD.fence OR NEW.rel OPERATOR(pg_catalog.<>) OLD.rel
          OR NEW.row_key OPERATOR(pg_catalog.<>) OLD.row_key)
    EXECUTE FUNCTION pgfence.reject_lowered_tombstone();

-- The check for SQL callers that want the rejection in the audit trail: like pgfence.check,
-- but a stale (PF001) or duplicate (PF004) token returns false instead of raising, after
-- appending an audit row (operation 'check', holder = the calling role). Returns true when
-- the lease holds the resource (the row lock is then held until the transaction ends, as
-- with check). Invalid arguments still raise 22023.
--
-- The audit row is part of the caller's transaction, like everything a function does: it is
-- kept when the caller COMMITs after a false (doing nothing else), and lost on ROLLBACK. In
-- autocommit (`psql -c "SELECT pgfence.try_check(...)"`) it commits at once. Callers MUST
-- test the result: false means a newer lease holds the resource, so the work must not run.
--
-- Runs with the caller's rights (it only calls check and append_audit, which run with the
-- owner's), so current_user is the role that called it.
CREATE FUNCTION pgfence.try_check(p_resource text, p_token bigint, p_tag integer DEFAULT 0)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_state text;
    v_detail text;
    v_current bigint;
BEGIN
    BEGIN
        PERFORM pgfence.check(p_resource, p_token, p_tag);
        RETURN true;
    EXCEPTION WHEN SQLSTATE 'PF001' OR SQLSTATE 'PF004' THEN
        GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_detail = PG_EXCEPTION_DETAIL;
    END;
    v_current := coalesce(substring(v_detail FROM 'current=([0-9]+)')::bigint, p_token);
    PERFORM pgfence.append_audit(p_resource, NULL, NULL, p_token, v_current, current_user::text,
                                 'check', v_state = 'PF001' AND strpos(v_detail, 'origin=other') > 0);
    RETURN false;
END
$$;

-- Recovery from a poisoned resource mark (a check with an absurdly high token, or a raw
-- write to pgfence.resource_fence): lowers the mark to token p_to_token, which should be the
-- highest token the issuer really handed out (`pgfence lock status` shows the counter).
-- Afterwards every lease with a token up to p_to_token is refused (the stored fence has all
-- tag and sequence bits set, so it is no lease's own fence) and p_to_token + 1 and above are
-- admitted; high_water() returns p_to_token. p_to_token = 0 removes the mark. Refuses to
-- raise a mark's token (22023). Records an audit row (operation 'unpoison', presented =
-- p_to_token, current = the token the mark had, holder = the calling role) and returns the
-- token the mark had (NULL when there was none: nothing changes, nothing is recorded).
--
-- Owner-only: runs with the caller's rights and is not granted to applications. Lowering a
-- mark below a token that really checked lets that lease's elders (zombies) in again.
CREATE FUNCTION pgfence.unpoison_resource(p_resource text, p_to_token bigint)
RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_old bigint;
BEGIN
    IF p_to_token IS NULL OR p_to_token < 0 OR p_to_token > 549755813887 THEN
        RAISE EXCEPTION 'pgfence: fence tokens are 0 to 549755813887, got %', p_to_token
            USING ERRCODE = '22023';
    END IF;
    SELECT r.fence >> 24 INTO v_old FROM pgfence.resource_fence r
     WHERE r.resource = p_resource FOR UPDATE;
    IF v_old IS NULL THEN
        RETURN NULL;
    END IF;
    IF p_to_token > v_old THEN
        RAISE EXCEPTION 'pgfence: unpoison_resource only lowers marks: % holds token %, not above %',
                p_resource, v_old, p_to_token
            USING ERRCODE = '22023';
    END IF;
    IF p_to_token = 0 THEN
        DELETE FROM pgfence.resource_fence WHERE resource = p_resource;
    ELSE
        UPDATE pgfence.resource_fence SET fence = (p_to_token << 24) | 16777215, updated_at = now()
         WHERE resource = p_resource;
    END IF;
    INSERT INTO pgfence.audit (resource, presented, current, holder, operation)
    VALUES (p_resource, p_to_token, v_old, current_user::text, 'unpoison');
    RETURN v_old;
END
$$;

-- Deny by default. Tables, views and sequences never had PUBLIC privileges; functions had
-- EXECUTE. This includes the trigger functions: PostgreSQL checks EXECUTE when a trigger is
-- created (by guard, owner-only), not when it fires on an application's UPDATE.
REVOKE ALL ON SCHEMA pgfence FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA pgfence FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA pgfence FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pgfence FROM PUBLIC;
-- The exception, explained above: it runs with the caller's rights and does nothing a caller
-- without EXECUTE on append_audit could not.
GRANT EXECUTE ON FUNCTION
    pgfence.record_rejection(text, text, text, bigint, bigint, text, text, integer, boolean)
    TO PUBLIC;
-- (Per-schema default privileges can only add to the global ones, so a later migration that
-- creates a function revokes PUBLIC's EXECUTE on it itself.)
