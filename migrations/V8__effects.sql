-- The effect ledger (pgfence::Effects): side effects outside PostgreSQL — a payment
-- provider's charge, an e-mail — recorded under a lease before they are made, with an
-- idempotency key that is the same for every holder of the work item.
--
-- An effect is one row per (scope, work_key, step), where the scope is the lease's token
-- counter: its resource, or its fencing domain ('{D}NAME' -> 'D'). Its idempotency key is
-- drawn at random when the first lease records the effect and never changes: a new holder of
-- the same work item, or a zombie that recorded it and paused before calling, sends the same
-- key, so a provider that honours idempotency keys makes the call once. The key never derives
-- from a token (a zombie's token differs from the new holder's).
--
-- The row's fence is a packed fence like a guarded row's (token << 24 | tag << 12 | sequence,
-- advanced by pgfence.next_fence): recording or finishing an effect is a fenced write. A lease
-- older than the one that last recorded the effect — or than the newest check of its
-- resource — is refused ('stale'), before it calls; so is an older lease's outcome, which
-- cannot overwrite a newer holder's.
--
-- The functions return a status instead of raising, so a refusal does not abort the caller's
-- transaction; the library audits the refusal through its own connection (it survives the
-- caller's rollback). Like the PostgreSQL issuer's functions they set enable_seqscan = off
-- (every lookup is by primary key; a cached plan must not keep a small table's sequential
-- scan). They run with their owner's rights; the application role gets EXECUTE
-- (pgfence grant) and nothing on the table.

CREATE TABLE pgfence.effect (
    scope           text        NOT NULL,
    work_key        text        NOT NULL,
    step            text        NOT NULL,
    idempotency_key text        NOT NULL UNIQUE,
    fence           bigint      NOT NULL,
    state           text        NOT NULL DEFAULT 'pending'
                                CHECK (state IN ('pending', 'succeeded', 'failed')),
    outcome         jsonb,
    holders         integer     NOT NULL DEFAULT 1,
    resource        text        NOT NULL,
    holder          text,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (scope, work_key, step)
);
REVOKE ALL ON pgfence.effect FROM PUBLIC;

CREATE FUNCTION pgfence.effect_check_args(p_resource text, p_work_key text, p_step text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_resource IS NULL OR p_resource = '' OR octet_length(p_resource) > 200 THEN
        RAISE EXCEPTION 'pgfence: a resource name is 1 to 200 bytes' USING ERRCODE = '22023';
    END IF;
    IF p_work_key IS NULL OR p_work_key = '' OR octet_length(p_work_key) > 200 THEN
        RAISE EXCEPTION 'pgfence: an effect''s work key is 1 to 200 bytes' USING ERRCODE = '22023';
    END IF;
    IF p_step IS NULL OR p_step = '' OR octet_length(p_step) > 100 THEN
        RAISE EXCEPTION 'pgfence: an effect''s step is 1 to 100 bytes' USING ERRCODE = '22023';
    END IF;
END
$$;

-- Records (or takes over) an effect before its call. Returns status 'ok' with the effect's
-- idempotency key, its state and the outcome a previous holder recorded ('succeeded' or
-- 'failed' with outcome: the call is known to be done; 'pending': make the call with the
-- key), and how many leases have recorded it. Returns 'stale' / 'duplicate' / 'exhausted'
-- (PF001 / PF004 / PF005 of pgfence.next_fence) with the token met, and nothing changed.
CREATE FUNCTION pgfence.effect_begin(p_resource text, p_work_key text, p_step text,
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
                holders = e.holders + CASE WHEN e.fence >> 24 < p_token THEN 1 ELSE 0 END,
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
                        v_row.holders, v_row.fence >> 24, false;
END
$$;

-- Records an effect's outcome after its call (p_succeeded: the call did what it was for;
-- false: it definitely did not, e.g. a declined card), fenced like effect_begin. Returns 'ok',
-- 'missing' (no lease recorded the effect first: nothing written), or 'stale' / 'duplicate' /
-- 'exhausted' with the token met (a newer holder's outcome is never overwritten).
CREATE FUNCTION pgfence.effect_finish(p_resource text, p_work_key text, p_step text,
                                      p_token bigint, p_tag integer, p_holder text,
                                      p_succeeded boolean, p_outcome jsonb)
RETURNS TABLE (status text, current bigint, other_counter boolean)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
DECLARE
    v_scope text := pgfence.issuer_counter_id(p_resource);
    v_mark bigint;
    v_code text;
    v_detail text;
BEGIN
    PERFORM pgfence.effect_check_args(p_resource, p_work_key, p_step);
    IF p_succeeded IS NULL THEN
        RAISE EXCEPTION 'pgfence: effect_finish needs p_succeeded' USING ERRCODE = '22023';
    END IF;
    v_mark := pgfence.high_water(p_resource);
    IF v_mark > p_token THEN
        RETURN QUERY SELECT 'stale'::text, v_mark, false;
        RETURN;
    END IF;
    BEGIN
        UPDATE pgfence.effect e
           SET fence = pgfence.next_fence(e.fence, p_token, p_tag, 'pgfence.effect'),
               state = CASE WHEN p_succeeded THEN 'succeeded' ELSE 'failed' END,
               outcome = p_outcome,
               resource = p_resource,
               holder = p_holder,
               updated_at = clock_timestamp()
         WHERE e.scope = v_scope AND e.work_key = p_work_key AND e.step = p_step;
        IF NOT FOUND THEN
            RETURN QUERY SELECT 'missing'::text, NULL::bigint, false;
            RETURN;
        END IF;
    EXCEPTION WHEN SQLSTATE 'PF001' OR SQLSTATE 'PF004' OR SQLSTATE 'PF005' THEN
        GET STACKED DIAGNOSTICS v_code = RETURNED_SQLSTATE, v_detail = PG_EXCEPTION_DETAIL;
        RETURN QUERY SELECT CASE v_code WHEN 'PF001' THEN 'stale'
                                        WHEN 'PF004' THEN 'duplicate'
                                        ELSE 'exhausted' END,
                            substring(v_detail FROM 'current=([0-9]+)')::bigint,
                            strpos(v_detail, 'origin=other') > 0;
        RETURN;
    END;
    RETURN QUERY SELECT 'ok'::text, p_token, false;
END
$$;

-- An effect as recorded (no fencing: a read). NULLs when no lease recorded it.
CREATE FUNCTION pgfence.effect_status(p_resource text, p_work_key text, p_step text)
RETURNS TABLE (idempotency_key text, state text, outcome jsonb, holders integer, token bigint,
               holder text, updated_at timestamptz)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
    SELECT e.idempotency_key, e.state, e.outcome, e.holders, e.fence >> 24, e.holder, e.updated_at
      FROM pgfence.effect e
     WHERE e.scope = pgfence.issuer_counter_id(p_resource)
       AND e.work_key = p_work_key AND e.step = p_step
$$;

REVOKE ALL ON FUNCTION
    pgfence.effect_check_args(text, text, text),
    pgfence.effect_begin(text, text, text, bigint, integer, text),
    pgfence.effect_finish(text, text, text, bigint, integer, text, boolean, jsonb),
    pgfence.effect_status(text, text, text)
FROM PUBLIC;
