-- V12: one home for the fence layout in SQL.
--
-- A stored fence is token << 24 | counter << 20 | holder << 12 | sequence (docs/design.md,
-- "What a token means"; in Rust, pgfence::StoredFence). Until V11 every function that reads
-- or writes a fence spelled the layout itself (>> 24, 4095, 2731, 15728640, 16777215...).
-- From here on the layout is written once, in the small helpers below, and every function
-- that needs it calls them; tests compare each helper with StoredFence, value by value,
-- including the extremes (the largest token, sealed fences, every tag bit).
--
-- The helpers are LANGUAGE sql IMMUTABLE with no SET clause and nothing a search_path could
-- resolve (operators are OPERATOR(pg_catalog.*), `bigint` is a keyword), like
-- pgfence.max_token_jump() (V10): the planner inlines them and folds calls on constants, so a
-- helper in a statement costs what its literal did. Each holds numbers only, so every role may
-- execute them (the functions that call them run as the caller, e.g. next_fence and admits).
--
-- The guard trigger's WHEN clause stays pure arithmetic on literals (PostgreSQL re-reads it
-- for every statement: V10, BENCHMARKS.md); guard_trigger_ddl now formats those literals from
-- the helpers, and every guard trigger is re-installed in its mode (the clause's text is the
-- same as V10's).
--
-- Behaviour, messages and grants are unchanged. Every statement is idempotent (CREATE OR
-- REPLACE), so the migration applies again over itself, like V10 and V11.

-- Where the token starts in a fence: fence = token << 24 | tag << 12 | sequence.
CREATE OR REPLACE FUNCTION pgfence.token_shift() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 24 $$;

-- Where the 12-bit tag (counter << 8 | holder) starts: above the 12-bit sequence.
CREATE OR REPLACE FUNCTION pgfence.tag_shift() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 12 $$;

-- The largest tag (12 bits).
CREATE OR REPLACE FUNCTION pgfence.max_tag() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 4095 $$;

-- The sequence of a sealed fence (every sequence bit set), and the modulus of a lease's
-- sequence cycle 0..4094.
CREATE OR REPLACE FUNCTION pgfence.sealed_sequence() RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 4095::bigint $$;

-- The step of a lease's sequence cycle: next = (sequence + step) mod 4095.
CREATE OR REPLACE FUNCTION pgfence.sequence_step() RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 2731::bigint $$;

-- The token of a fence (0 for a fence no lease wrote).
CREATE OR REPLACE FUNCTION pgfence.fence_token(p_fence bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT p_fence OPERATOR(pg_catalog.>>) pgfence.token_shift() $$;

-- The largest token: the token of the largest bigint (549755813887, 2^39 - 1).
CREATE OR REPLACE FUNCTION pgfence.max_token() RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT pgfence.fence_token(9223372036854775807::bigint) $$;

-- The lowest fence of a token (tag and sequence 0): every fence below it is an older lease's.
CREATE OR REPLACE FUNCTION pgfence.token_fence(p_token bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT p_token OPERATOR(pg_catalog.<<) pgfence.token_shift() $$;

-- The 4-bit hash of the counter a fence's token came from (the tag's high 4 bits).
CREATE OR REPLACE FUNCTION pgfence.fence_counter(p_fence bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT (p_fence OPERATOR(pg_catalog.>>) (pgfence.tag_shift() OPERATOR(pg_catalog.+) 8))
           OPERATOR(pg_catalog.&) 15::bigint
$$;

-- The 8-bit hash of a fence's holder (the tag's low 8 bits).
CREATE OR REPLACE FUNCTION pgfence.fence_holder(p_fence bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT (p_fence OPERATOR(pg_catalog.>>) pgfence.tag_shift()) OPERATOR(pg_catalog.&) 255::bigint
$$;

-- A fence's sequence: 0..4094 on its lease's cycle, 4095 sealed.
CREATE OR REPLACE FUNCTION pgfence.fence_sequence(p_fence bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT p_fence OPERATOR(pg_catalog.&) pgfence.sealed_sequence() $$;

-- The lease fence a fence belongs to: its token and tag, sequence 0.
CREATE OR REPLACE FUNCTION pgfence.fence_lease(p_fence bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT p_fence OPERATOR(pg_catalog.&) (OPERATOR(pg_catalog.~) pgfence.sealed_sequence()) $$;

-- The same fence sealed: changed outside the fencing protocol after its lease wrote it.
CREATE OR REPLACE FUNCTION pgfence.sealed_fence(p_fence bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT p_fence OPERATOR(pg_catalog.|) pgfence.sealed_sequence() $$;

-- What the same lease's next write stores over a fence: the next step of its sequence
-- cycle; NULL for a sealed fence (that lease may not write it again).
CREATE OR REPLACE FUNCTION pgfence.next_step(p_fence bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN pgfence.fence_sequence(p_fence) OPERATOR(pg_catalog.=) pgfence.sealed_sequence()
                THEN NULL
                ELSE pgfence.fence_lease(p_fence) OPERATOR(pg_catalog.+)
                     ((pgfence.fence_sequence(p_fence) OPERATOR(pg_catalog.+) pgfence.sequence_step())
                      OPERATOR(pg_catalog.%) pgfence.sealed_sequence()) END
$$;

-- Whether a fence a lease wrote (token above 0) came from another counter than p_lease's:
-- tokens of two counters do not compare.
CREATE OR REPLACE FUNCTION pgfence.other_counter(p_fence bigint, p_lease bigint) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT pgfence.fence_token(p_fence) OPERATOR(pg_catalog.>) 0
       AND pgfence.fence_counter(p_fence) OPERATOR(pg_catalog.<>) pgfence.fence_counter(p_lease)
$$;

-- Numbers only, read by functions that run as the caller (next_fence, admits, lease_fence)
-- and inlined into what any role runs: every role may execute them, like max_token_jump().
GRANT EXECUTE ON FUNCTION pgfence.token_shift(), pgfence.tag_shift(), pgfence.max_tag(),
    pgfence.sealed_sequence(), pgfence.sequence_step(), pgfence.fence_token(bigint),
    pgfence.max_token(), pgfence.token_fence(bigint), pgfence.fence_counter(bigint),
    pgfence.fence_holder(bigint), pgfence.fence_sequence(bigint), pgfence.fence_lease(bigint),
    pgfence.sealed_fence(bigint), pgfence.next_step(bigint), pgfence.other_counter(bigint, bigint)
    TO PUBLIC;

-- Every function below is the newest form of its migration (named before each), reading the
-- layout from the helpers; nothing else in it changes.

-- lease_fence (V4).
CREATE OR REPLACE FUNCTION pgfence.lease_fence(p_token bigint, p_tag integer) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_token IS NULL OR p_token < 1 OR p_token > pgfence.max_token() THEN
        RAISE EXCEPTION 'pgfence: fence tokens are 1 to %, got %', pgfence.max_token(), p_token
            USING ERRCODE = '22023';
    END IF;
    IF p_tag IS NULL OR p_tag < 0 OR p_tag > pgfence.max_tag() THEN
        RAISE EXCEPTION 'pgfence: lease tags are 0 to %, got %', pgfence.max_tag(), p_tag USING ERRCODE = '22023';
    END IF;
    RETURN pgfence.token_fence(p_token) | (p_tag::bigint << pgfence.tag_shift());
END
$$;

-- next_fence (V10).
CREATE OR REPLACE FUNCTION pgfence.next_fence(p_current bigint, p_token bigint, p_tag integer DEFAULT 0,
                                              p_table text DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    lease bigint := pgfence.lease_fence(p_token, p_tag);
    cur bigint := coalesce(p_current, 0);
    other_counter boolean := pgfence.other_counter(cur, lease);
    code text;
BEGIN
    PERFORM pgfence.refuse_token_jump(pgfence.fence_token(cur), p_token, 'table=' || coalesce(p_table, '?'));
    IF cur < pgfence.token_fence(p_token) THEN
        RETURN lease;
    ELSIF pgfence.fence_lease(cur) = lease AND cur <> pgfence.sealed_fence(cur) THEN
        RETURN pgfence.next_step(cur);
    ELSIF cur = pgfence.sealed_fence(lease) THEN
        code := 'PF005';
    ELSIF pgfence.fence_token(cur) = p_token AND NOT other_counter THEN
        code := 'PF004';
    ELSE
        code := 'PF001';
    END IF;
    RAISE EXCEPTION 'pgfence: % on %: presented token %, current token %',
            CASE code WHEN 'PF001' THEN 'stale fence token'
                      WHEN 'PF004' THEN 'duplicate fence token (the counter went backwards; reseed it)'
                      ELSE 'row sealed: changed outside the fencing protocol after this lease wrote it (take a new lease and re-read)' END,
            coalesce(p_table, 'a row'), p_token, pgfence.fence_token(cur)
        USING ERRCODE = code,
              DETAIL = format('presented=%s current=%s %stable=%s', p_token, pgfence.fence_token(cur),
                              CASE WHEN other_counter THEN 'origin=other ' ELSE '' END,
                              coalesce(p_table, '?')),
              HINT = CASE code WHEN 'PF001' THEN 'a newer lease holds this row: this job must stop'
                               WHEN 'PF004' THEN 'reseed the counter (pgfence reseed) and take a new lease'
                               ELSE 'take a new lease and re-read the row' END;
END
$$;

-- admits (V10).
CREATE OR REPLACE FUNCTION pgfence.admits(p_current bigint, p_token bigint, p_tag integer, p_table regclass,
                               p_key text DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_table text;
    v_state text;
    v_detail text;
    v_message text;
BEGIN
    -- The table as the audit trail spells every table (the argument was resolved with the
    -- caller's search_path when it was cast to regclass).
    SELECT pgfence.quoted_table(n.nspname, c.relname) INTO v_table
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = p_table;
    BEGIN
        PERFORM pgfence.next_fence(p_current, p_token, p_tag, v_table);
        RETURN true;
    EXCEPTION WHEN SQLSTATE 'PF001' OR SQLSTATE 'PF004' OR SQLSTATE 'PF005' OR SQLSTATE 'PF008' THEN
        GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_detail = PG_EXCEPTION_DETAIL,
                                v_message = MESSAGE_TEXT;
    END;
    PERFORM pgfence.append_audit(NULL, v_table, p_key, p_token, pgfence.fence_token(coalesce(p_current, 0)),
                                 current_user::text, 'update',
                                 strpos(v_detail, 'origin=other') > 0);
    v_message := regexp_replace(v_message, '^pgfence: ', '');
    -- Session level on purpose: the statement's own transaction commits the audit row, and
    -- pgfence.stop_unless in the script's next statement reports this rejection.
    PERFORM set_config('pgfence.rejected', format('%s (row %s)', v_message, coalesce(p_key, '?')), false);
    RAISE WARNING 'pgfence: % (row %; recorded in pgfence.audit)', v_message, coalesce(p_key, '?')
        USING DETAIL = v_detail;
    RETURN false;
END
$$;

-- check (V10).
CREATE OR REPLACE FUNCTION pgfence.check(p_resource text, p_token bigint, p_tag integer DEFAULT 0)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    lease bigint;
    cur bigint;
    other_counter boolean;
BEGIN
    IF p_token IS NULL OR p_token <= 0 THEN
        RAISE EXCEPTION 'pgfence: fence tokens are positive, got %', p_token USING ERRCODE = '22023';
    END IF;
    IF p_resource IS NULL OR length(p_resource) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'pgfence: resource names are 1 to 200 characters' USING ERRCODE = '22023';
    END IF;
    lease := pgfence.lease_fence(p_token, p_tag);
    SELECT r.fence INTO cur FROM pgfence.resource_fence r WHERE r.resource = p_resource;
    PERFORM pgfence.refuse_token_jump(pgfence.fence_token(cur), p_token, 'resource=' || p_resource);

    INSERT INTO pgfence.resource_fence AS r (resource, fence)
    VALUES (p_resource, lease)
    ON CONFLICT (resource) DO UPDATE
        SET fence = EXCLUDED.fence, updated_at = now()
        WHERE r.fence < pgfence.token_fence(p_token) OR r.fence = EXCLUDED.fence;
    IF FOUND THEN
        RETURN;
    END IF;

    -- ON CONFLICT left the row locked; read the mark that beat us.
    SELECT r.fence INTO cur FROM pgfence.resource_fence r WHERE r.resource = p_resource;
    other_counter := pgfence.other_counter(cur, lease);
    IF pgfence.fence_token(cur) = p_token AND NOT other_counter THEN
        RAISE EXCEPTION 'pgfence: duplicate fence token for resource %: token % was already presented by another lease (the counter went backwards; reseed it)',
                p_resource, p_token
            USING ERRCODE = 'PF004',
                  DETAIL = format('presented=%s current=%s resource=%s', p_token, p_token, p_resource);
    END IF;
    RAISE EXCEPTION 'pgfence: stale fence token for resource %: presented %, current %',
            p_resource, p_token, pgfence.fence_token(cur)
        USING ERRCODE = 'PF001',
              DETAIL = format('presented=%s current=%s %sresource=%s', p_token, pgfence.fence_token(cur),
                              CASE WHEN other_counter THEN 'origin=other ' ELSE '' END, p_resource);
END
$$;

-- high_water (V4).
CREATE OR REPLACE FUNCTION pgfence.high_water(p_resource text) RETURNS bigint
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT coalesce((SELECT pgfence.fence_token(fence) FROM pgfence.resource_fence WHERE resource = p_resource), 0)
$$;

-- domain_high_water (V4).
CREATE OR REPLACE FUNCTION pgfence.domain_high_water(p_domain text) RETURNS bigint
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT coalesce(max(pgfence.fence_token(fence)), 0) FROM pgfence.resource_fence
     WHERE left(resource, length(p_domain) + 2) = '{' || p_domain || '}'
$$;

-- domain_mark_holder (V10).
CREATE OR REPLACE FUNCTION pgfence.domain_mark_holder(p_domain text, p_token bigint) RETURNS text
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT r.resource FROM pgfence.resource_fence r
     WHERE left(r.resource, length(p_domain) + 2) = '{' || p_domain || '}'
       AND pgfence.fence_token(r.fence) = p_token
     ORDER BY r.resource
     LIMIT 1
$$;

-- unpoison_resource (V5).
CREATE OR REPLACE FUNCTION pgfence.unpoison_resource(p_resource text, p_to_token bigint)
RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_old bigint;
BEGIN
    IF p_to_token IS NULL OR p_to_token < 0 OR p_to_token > pgfence.max_token() THEN
        RAISE EXCEPTION 'pgfence: fence tokens are 0 to %, got %', pgfence.max_token(), p_to_token
            USING ERRCODE = '22023';
    END IF;
    SELECT pgfence.fence_token(r.fence) INTO v_old FROM pgfence.resource_fence r
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
        UPDATE pgfence.resource_fence SET fence = pgfence.token_fence(p_to_token + 1) - 1, updated_at = now()
         WHERE resource = p_resource;
    END IF;
    INSERT INTO pgfence.audit (resource, presented, current, holder, operation)
    VALUES (p_resource, p_to_token, v_old, current_user::text, 'unpoison');
    RETURN v_old;
END
$$;

-- reject_lowered_tombstone (V5).
CREATE OR REPLACE FUNCTION pgfence.reject_lowered_tombstone() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'pgfence: a tombstone''s fence never goes down (presented token %, current token %)',
            pgfence.fence_token(NEW.fence), pgfence.fence_token(OLD.fence)
        USING ERRCODE = '42501',
              DETAIL = format('presented=%s current=%s table=pgfence.tombstone',
                              pgfence.fence_token(NEW.fence), pgfence.fence_token(OLD.fence)),
              HINT = 'the table owner can delete a tombstone',
              SCHEMA = 'pgfence',
              TABLE = 'tombstone',
              COLUMN = 'fence';
END
$$;

-- effect_begin (V8).
CREATE OR REPLACE FUNCTION pgfence.effect_begin(p_resource text, p_work_key text, p_step text,
                                     p_token bigint, p_tag integer, p_holder text)
RETURNS TABLE (status text, idempotency_key text, state text, outcome jsonb, holders integer,
               current bigint, other_counter boolean)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
DECLARE
    v_scope text := pgfence.issuer_counter_id(p_resource);
    v_mark bigint;
    v_row pgfence.effect;
    v_code text;
    v_detail text;
BEGIN
    PERFORM pgfence.effect_check_args(p_resource, p_work_key, p_step);
    -- A newer lease already checked the resource: fenced out before the call.
    v_mark := pgfence.high_water(p_resource);
    IF v_mark > p_token THEN
        RETURN QUERY SELECT 'stale'::text, NULL::text, NULL::text, NULL::jsonb, NULL::integer,
                            v_mark, false;
        RETURN;
    END IF;
    BEGIN
        INSERT INTO pgfence.effect AS e (scope, work_key, step, idempotency_key, fence,
                                         resource, holder)
        VALUES (v_scope, p_work_key, p_step, gen_random_uuid()::text,
                pgfence.lease_fence(p_token, p_tag), p_resource, p_holder)
        ON CONFLICT (scope, work_key, step) DO UPDATE
            SET fence = pgfence.next_fence(e.fence, p_token, p_tag, 'pgfence.effect'),
                holders = e.holders + CASE WHEN pgfence.fence_token(e.fence) < p_token THEN 1 ELSE 0 END,
                resource = p_resource,
                holder = p_holder,
                updated_at = clock_timestamp()
        RETURNING e.* INTO v_row;
    EXCEPTION WHEN SQLSTATE 'PF001' OR SQLSTATE 'PF004' OR SQLSTATE 'PF005' THEN
        GET STACKED DIAGNOSTICS v_code = RETURNED_SQLSTATE, v_detail = PG_EXCEPTION_DETAIL;
        RETURN QUERY SELECT CASE v_code WHEN 'PF001' THEN 'stale'
                                        WHEN 'PF004' THEN 'duplicate'
                                        ELSE 'exhausted' END,
                            NULL::text, NULL::text, NULL::jsonb, NULL::integer,
                            substring(v_detail FROM 'current=([0-9]+)')::bigint,
                            strpos(v_detail, 'origin=other') > 0;
        RETURN;
    END;
    RETURN QUERY SELECT 'ok'::text, v_row.idempotency_key, v_row.state, v_row.outcome,
                        v_row.holders, pgfence.fence_token(v_row.fence), false;
END
$$;

-- effect_status (V8).
CREATE OR REPLACE FUNCTION pgfence.effect_status(p_resource text, p_work_key text, p_step text)
RETURNS TABLE (idempotency_key text, state text, outcome jsonb, holders integer, token bigint,
               holder text, updated_at timestamptz)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
    SELECT e.idempotency_key, e.state, e.outcome, e.holders, pgfence.fence_token(e.fence), e.holder, e.updated_at
      FROM pgfence.effect e
     WHERE e.scope = pgfence.issuer_counter_id(p_resource)
       AND e.work_key = p_work_key AND e.step = p_step
$$;

-- set_max_token_jump (V10).
CREATE OR REPLACE FUNCTION pgfence.set_max_token_jump(p_jump bigint) RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_old bigint := pgfence.max_token_jump();
BEGIN
    IF p_jump IS NULL OR p_jump < 1 OR p_jump > pgfence.max_token() THEN
        RAISE EXCEPTION 'pgfence: the token jump bound is 1 to %, got %', pgfence.max_token(), p_jump
            USING ERRCODE = '22023';
    END IF;
    EXECUTE format('CREATE OR REPLACE FUNCTION pgfence.max_token_jump() RETURNS bigint '
                   'LANGUAGE sql IMMUTABLE PARALLEL SAFE '
                   'AS $f$ SELECT %s::bigint $f$', p_jump);
    -- The guard triggers' WHEN clauses carry the bound: re-install them, in their modes.
    PERFORM pgfence.install_guard_trigger(t.tgrelid::regclass, pgfence.trigger_mode(t.tgnargs, t.tgargs))
       FROM pg_trigger t
      WHERE t.tgname = 'pgfence_guard' AND NOT t.tgisinternal;
    RETURN v_old;
END
$$;

-- reject_stale_update (V10).
CREATE OR REPLACE FUNCTION pgfence.reject_stale_update() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_observe boolean := TG_NARGS > 0 AND TG_ARGV[0] = 'observe';
    v_reason text := nullif(btrim(current_setting('pgfence.bypass', true)), '');
    v_xact_ok boolean := coalesce(current_setting('pgfence.bypass_xact', true) = txid_current()::text, false);
    v_role text := CASE WHEN current_setting('role') = 'none' THEN session_user::text
                        ELSE current_setting('role') END;
    v_app text := current_setting('application_name', true);
    v_table text := pgfence.quoted_table(TG_TABLE_SCHEMA, TG_TABLE_NAME);
    v_advanced boolean := NEW.fence > OLD.fence;
    v_allowed boolean := false;
    v_note text;
    v_cols text;
    v_builtin boolean;
    v_key text;
    v_old bigint := OLD.fence;
BEGIN
    -- A token absurdly far ahead: refused in every mode.
    PERFORM pgfence.refuse_token_jump(pgfence.fence_token(OLD.fence), pgfence.fence_token(NEW.fence), 'table=' || v_table);
    -- A lease's write that the WHEN clause's filter did not recognise (a fresh row's first
    -- token beyond the bound): let through.
    IF (pgfence.fence_token(NEW.fence) > pgfence.fence_token(OLD.fence)
        AND pgfence.fence_sequence(NEW.fence) = 0)
       OR NEW.fence = pgfence.next_step(OLD.fence) THEN
        RETURN NEW;
    END IF;
    IF v_reason IS NOT NULL AND NOT v_xact_ok THEN
        v_note := 'pgfence.bypass was not set by pgfence.bypass() in this transaction (a plain SET outlives its transaction)';
        IF NOT v_observe THEN
            RAISE EXCEPTION 'pgfence: bypass refused on %: %', v_table, v_note
                USING ERRCODE = 'PF006',
                      DETAIL = format('role=%s reason=%s', v_role, v_reason),
                      HINT = 'BEGIN; SELECT pgfence.bypass(''<reason>''); UPDATE ...; COMMIT;',
                      SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'fence';
        END IF;
    ELSIF v_reason IS NOT NULL THEN
        v_allowed := pgfence.may_bypass(v_role);
        IF NOT v_allowed THEN
            v_note := format('role %I may not bypass the guard (the schema owner runs pgfence.allow_bypass(role))',
                             v_role);
            IF NOT v_observe THEN
                RAISE EXCEPTION 'pgfence: bypass refused on %: %', v_table, v_note
                    USING ERRCODE = 'PF006',
                          DETAIL = format('role=%s reason=%s', v_role, v_reason),
                          HINT = 'ask the schema owner to run pgfence.allow_bypass for this role, or write under a lease (pgfence run, pgfence.next_fence)',
                          SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'fence';
            END IF;
        END IF;
    ELSIF NOT v_observe THEN
        IF v_advanced THEN
            RAISE EXCEPTION 'pgfence: lease-less write refused on %: fence % -> % is not a lease''s write (fence = fence + n is not one); this rejection is recorded only in the PostgreSQL server log',
                    v_table, OLD.fence, NEW.fence
                USING ERRCODE = 'PF007',
                      DETAIL = format('old=%s new=%s table=%s', OLD.fence, NEW.fence, v_table),
                      HINT = 'write under a lease (pgfence run; fence = pgfence.next_fence(fence, $PGFENCE_TOKEN, $PGFENCE_TAG)), or as an allowed role: BEGIN; SELECT pgfence.bypass(''<reason>''); UPDATE ...; COMMIT;',
                      SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'fence';
        END IF;
        RAISE EXCEPTION 'pgfence: stale fence on %: presented token %, current token % (every UPDATE of a guarded table must be a lease''s write); this rejection is recorded only in the PostgreSQL server log',
                v_table, pgfence.fence_token(NEW.fence), pgfence.fence_token(OLD.fence)
            USING ERRCODE = 'PF001',
                  DETAIL = format('presented=%s current=%s table=%s',
                                  pgfence.fence_token(NEW.fence), pgfence.fence_token(OLD.fence), v_table),
                  HINT = 'set fence = pgfence.next_fence(fence, <token>, <tag>) under a lease (pgfence run), write through the pgfence repository, or bypass: BEGIN; SELECT pgfence.bypass(''<reason>''); UPDATE ...; COMMIT;',
                  SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'fence';
    END IF;

    -- Let through: a bypass by an allowed role, or observe mode. Say which row.
    SELECT string_agg(format('($1).%I', a.attname), ', ' ORDER BY k.ord),
           bool_and(a.atttypid < 16384)
      INTO v_cols, v_builtin
      FROM pg_index i
     CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
      JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
     WHERE i.indrelid = TG_RELID AND i.indisprimary;
    IF v_cols IS NOT NULL AND v_builtin THEN
        EXECUTE format('SELECT pg_catalog.jsonb_build_array(%s)::pg_catalog.text', v_cols)
           INTO v_key USING OLD;
    END IF;

    -- Seal the row against every lease that wrote it before (see the header): the lease
    -- whose fence the row had cannot write it again, and neither can anything older. A fence
    -- of a newer token set by hand is sealed too.
    NEW.fence := CASE WHEN pgfence.fence_token(NEW.fence) > pgfence.fence_token(v_old)
                      THEN pgfence.sealed_fence(NEW.fence)
                      ELSE pgfence.sealed_fence(v_old) END;

    IF v_allowed THEN
        INSERT INTO pgfence.audit (table_name, row_key, presented, current, holder, operation,
                                   application_name, reason)
        VALUES (v_table, v_key, pgfence.fence_token(NEW.fence), pgfence.fence_token(v_old), v_role, 'bypass', v_app, v_reason);
        RAISE WARNING 'pgfence: guard bypassed on % row % by role % (application %): %',
                v_table, coalesce(v_key, '?'), v_role, coalesce(v_app, ''), v_reason
            USING DETAIL = format('presented=%s current=%s table=%s', pgfence.fence_token(NEW.fence), pgfence.fence_token(v_old), v_table);
    ELSE
        INSERT INTO pgfence.audit (table_name, row_key, presented, current, holder, operation,
                                   application_name, reason)
        VALUES (v_table, v_key, pgfence.fence_token(NEW.fence), pgfence.fence_token(v_old), v_role, 'observe', v_app,
                CASE WHEN v_note IS NOT NULL
                     THEN format('bypass %L refused: %s', v_reason, v_note) END);
        RAISE WARNING 'pgfence: observe mode: unfenced update of % row % by role % (application %) would be rejected when enforcing (row sealed against earlier leases)%',
                v_table, coalesce(v_key, '?'), v_role, coalesce(v_app, ''),
                CASE WHEN v_note IS NULL THEN '' ELSE '; ' || v_note END
            USING DETAIL = format('presented=%s current=%s table=%s', pgfence.fence_token(NEW.fence), pgfence.fence_token(v_old), v_table),
                  HINT = 'write under a lease (pgfence run, pgfence.next_fence), or as an allowed role: SELECT pgfence.bypass(''<reason>'') in the transaction';
    END IF;
    RETURN NEW;
END
$$;

-- guard_trigger_ddl (V10).
CREATE OR REPLACE FUNCTION pgfence.guard_trigger_ddl(p_rel regclass, p_mode text) RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT format(
        'TRIGGER pgfence_guard BEFORE UPDATE ON %s FOR EACH ROW '
        'WHEN ((NEW.fence OPERATOR(pg_catalog.<=) (OLD.fence OPERATOR(pg_catalog.|) %s::pg_catalog.int8) '
        'AND (NEW.fence OPERATOR(pg_catalog.-) OLD.fence) OPERATOR(pg_catalog.<>) ALL (''{%s,%s}''::pg_catalog.int8[])) '
        'OR (NEW.fence OPERATOR(pg_catalog.-) OLD.fence) OPERATOR(pg_catalog.>) %s::pg_catalog.int8) '
        'EXECUTE FUNCTION pgfence.reject_stale_update(%s)', p_rel,
        pgfence.token_fence(1) - 1,
        pgfence.sequence_step(), pgfence.sequence_step() - pgfence.sealed_sequence(),
        pgfence.token_fence(pgfence.max_token_jump()),
        CASE p_mode WHEN 'observe' THEN '''observe''' ELSE '' END)
$$;

-- Every guard trigger is re-installed from guard_trigger_ddl, in its mode (a disabled one
-- stays disabled: install_guard_trigger, V10).
DO $$
DECLARE
    v record;
BEGIN
    FOR v IN SELECT t.tgrelid::regclass AS rel, pgfence.trigger_mode(t.tgnargs, t.tgargs) AS mode
               FROM pg_trigger t
              WHERE t.tgname = 'pgfence_guard' AND NOT t.tgisinternal
              ORDER BY t.tgrelid
    LOOP
        PERFORM pgfence.install_guard_trigger(v.rel, v.mode);
    END LOOP;
END
$$;
