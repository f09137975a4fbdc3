-- The PostgreSQL issuer (pgfence::PgIssuer): leases and fence tokens kept in the database the
-- fences live in. A lock is a row of pgfence.issuer_lock, a token counter a row of
-- pgfence.issuer_counter; both are keyed by the issuer's key prefix, so two prefixes on one
-- database share no lock and no counter.
--
-- * Expiry is by the database clock (clock_timestamp()), never the client's.
-- * Every operation is one statement calling one function: no session state (no advisory
--   lock, no SET, no LISTEN), so it works through a transaction-mode pooler.
-- * The functions run with their owner's rights (SECURITY DEFINER, pinned search_path, static
--   SQL only). An application role gets EXECUTE on them (pgfence grant) and nothing on the
--   tables: it can take a free lock and release or extend a lock it holds (owner id and token
--   both match), never lower a counter or take a live lock from its holder.
-- * The functions that read or write the tables also set enable_seqscan = off: PL/pgSQL
--   caches one plan per statement per session, and a session that planned while a table was
--   small kept a sequential scan as the table grew (measured in the bench: an acquire at
--   20,000 rows took 4.2 ms instead of 0.3 ms). Every lookup here is by primary key.
-- * The counter and the fences it protects commit in the same WAL: a token can never be
--   behind a fence written after it was issued, and a database failover moves both together.
--   There is nothing to reseed.

CREATE TABLE pgfence.issuer_counter (
    prefix  text   NOT NULL,
    counter text   NOT NULL,
    value   bigint NOT NULL CHECK (value >= 0),
    PRIMARY KEY (prefix, counter)
);

CREATE TABLE pgfence.issuer_lock (
    prefix     text        NOT NULL,
    resource   text        NOT NULL,
    owner      text        NOT NULL,
    token      bigint      NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (prefix, resource)
);

REVOKE ALL ON pgfence.issuer_counter, pgfence.issuer_lock FROM PUBLIC;

-- The counter a resource draws tokens from: its fencing domain ('{D}NAME' -> 'D'), else itself.
CREATE FUNCTION pgfence.issuer_counter_id(p_resource text) RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE
        WHEN left(p_resource, 1) OPERATOR(pg_catalog.=) '{'
             AND strpos(p_resource, '}') OPERATOR(pg_catalog.>) 2
        THEN substr(p_resource, 2, strpos(p_resource, '}') OPERATOR(pg_catalog.-) 2)
        ELSE p_resource
    END
$$;

-- Refuses bad arguments (22023) before anything is read or written.
CREATE FUNCTION pgfence.issuer_check_args(p_prefix text, p_resource text, p_owner text,
                                          p_ttl_ms bigint) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_prefix IS NULL OR p_prefix OPERATOR(pg_catalog.=) ''
       OR octet_length(p_prefix) OPERATOR(pg_catalog.>) 64 THEN
        RAISE EXCEPTION 'pgfence: a key prefix is 1 to 64 bytes' USING ERRCODE = '22023';
    END IF;
    IF p_resource IS NULL OR p_resource OPERATOR(pg_catalog.=) ''
       OR octet_length(p_resource) OPERATOR(pg_catalog.>) 200 THEN
        RAISE EXCEPTION 'pgfence: a resource name is 1 to 200 bytes' USING ERRCODE = '22023';
    END IF;
    IF p_owner IS NOT NULL AND (p_owner OPERATOR(pg_catalog.=) ''
       OR strpos(p_owner, ':') OPERATOR(pg_catalog.>) 0
       OR octet_length(p_owner) OPERATOR(pg_catalog.>) 256) THEN
        RAISE EXCEPTION 'pgfence: owner ids are 1 to 256 bytes and contain no '':'''
            USING ERRCODE = '22023';
    END IF;
    IF p_ttl_ms IS NOT NULL AND (p_ttl_ms OPERATOR(pg_catalog.<) 10
       OR p_ttl_ms OPERATOR(pg_catalog.>) 86400000) THEN
        RAISE EXCEPTION 'pgfence: a lease TTL is 10 ms to 24 h, not % ms', p_ttl_ms
            USING ERRCODE = '22023';
    END IF;
END
$$;

-- Takes p_resource's lock for p_ttl_ms if it is free or expired and mints its token from the
-- resource's (or its domain's) counter. Returns (true, token, ttl_ms) when granted: also to
-- the same owner again while it holds the lock (the retry after a lost reply: same token, TTL
-- renewed). Returns (false, NULL, remaining ms) when another owner holds it.
--
-- A counter that does not exist yet starts above the high-water mark PostgreSQL recorded for
-- the resource (or the domain), so a resource that was fenced with another issuer's tokens
-- keeps working. A token past 549755813887 (pgfence's limit) is refused with 22003 and, since
-- the whole statement then rolls back, the lock and the counter stay as they were.
CREATE FUNCTION pgfence.issuer_acquire(p_prefix text, p_resource text, p_owner text,
                                       p_ttl_ms bigint)
RETURNS TABLE (acquired boolean, token bigint, ttl_ms bigint)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
DECLARE
    v_until timestamptz;
    v_held pgfence.issuer_lock;
    v_counter text;
    v_floor bigint;
    v_token bigint;
BEGIN
    IF p_owner IS NULL OR p_ttl_ms IS NULL THEN
        RAISE EXCEPTION 'pgfence: issuer_acquire needs an owner id and a TTL' USING ERRCODE = '22023';
    END IF;
    PERFORM pgfence.issuer_check_args(p_prefix, p_resource, p_owner, p_ttl_ms);
    v_until := clock_timestamp() OPERATOR(pg_catalog.+)
               make_interval(secs => p_ttl_ms::double precision OPERATOR(pg_catalog./) 1000);
    -- Take the row if it is new or its lock has expired. A conflicting row that is not taken
    -- is still locked by this statement, so what is read next is what holds it.
    INSERT INTO pgfence.issuer_lock AS l (prefix, resource, owner, token, expires_at)
    VALUES (p_prefix, p_resource, p_owner, 0, v_until)
    ON CONFLICT (prefix, resource) DO UPDATE
        SET owner = EXCLUDED.owner, token = 0, expires_at = EXCLUDED.expires_at
        WHERE l.expires_at OPERATOR(pg_catalog.<=) clock_timestamp();
    IF NOT FOUND THEN
        SELECT * INTO v_held FROM pgfence.issuer_lock l
         WHERE l.prefix OPERATOR(pg_catalog.=) p_prefix
           AND l.resource OPERATOR(pg_catalog.=) p_resource;
        IF v_held.owner OPERATOR(pg_catalog.=) p_owner THEN
            UPDATE pgfence.issuer_lock l SET expires_at = v_until
             WHERE l.prefix OPERATOR(pg_catalog.=) p_prefix
               AND l.resource OPERATOR(pg_catalog.=) p_resource;
            RETURN QUERY SELECT true, v_held.token, p_ttl_ms;
            RETURN;
        END IF;
        RETURN QUERY SELECT false, NULL::bigint,
            greatest(1, ceil(extract(epoch FROM v_held.expires_at OPERATOR(pg_catalog.-)
                                                 clock_timestamp())
                             OPERATOR(pg_catalog.*) 1000))::bigint;
        RETURN;
    END IF;
    v_counter := pgfence.issuer_counter_id(p_resource);
    UPDATE pgfence.issuer_counter c SET value = c.value OPERATOR(pg_catalog.+) 1
     WHERE c.prefix OPERATOR(pg_catalog.=) p_prefix
       AND c.counter OPERATOR(pg_catalog.=) v_counter
    RETURNING c.value INTO v_token;
    IF NOT FOUND THEN
        IF v_counter OPERATOR(pg_catalog.=) p_resource THEN
            v_floor := pgfence.high_water(p_resource);
        ELSE
            v_floor := pgfence.domain_high_water(v_counter);
        END IF;
        INSERT INTO pgfence.issuer_counter AS c (prefix, counter, value)
        VALUES (p_prefix, v_counter, v_floor OPERATOR(pg_catalog.+) 1)
        ON CONFLICT (prefix, counter) DO UPDATE SET value = c.value OPERATOR(pg_catalog.+) 1
        RETURNING c.value INTO v_token;
    END IF;
    IF v_token OPERATOR(pg_catalog.>) 549755813887 THEN
        RAISE EXCEPTION 'pgfence: the token counter of % would pass the token limit 549755813887',
                p_resource
            USING ERRCODE = '22003',
                  DETAIL = format('counter=%s token=%s', v_counter, v_token);
    END IF;
    UPDATE pgfence.issuer_lock l SET token = v_token
     WHERE l.prefix OPERATOR(pg_catalog.=) p_prefix
       AND l.resource OPERATOR(pg_catalog.=) p_resource;
    RETURN QUERY SELECT true, v_token, p_ttl_ms;
END
$$;

-- What a lease's release or extend found when it does not hold the lock: -1 when another
-- lease holds it, 0 when nobody does (expired, released, or deleted).
CREATE FUNCTION pgfence.issuer_not_held(p_prefix text, p_resource text) RETURNS integer
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
    SELECT CASE WHEN EXISTS (
        SELECT 1 FROM pgfence.issuer_lock l
         WHERE l.prefix OPERATOR(pg_catalog.=) p_prefix
           AND l.resource OPERATOR(pg_catalog.=) p_resource
           AND l.expires_at OPERATOR(pg_catalog.>) clock_timestamp()
    ) THEN -1 ELSE 0 END
$$;

-- Releases the lock if the lease (owner and token) holds it: 1 released, 0 it had expired
-- (nobody holds it; a lapsed row of this lease is removed), -1 another lease holds it
-- (untouched). The counter is left alone.
CREATE FUNCTION pgfence.issuer_release(p_prefix text, p_resource text, p_owner text,
                                       p_token bigint) RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
DECLARE
    v_expires timestamptz;
BEGIN
    PERFORM pgfence.issuer_check_args(p_prefix, p_resource, p_owner, NULL);
    DELETE FROM pgfence.issuer_lock l
     WHERE l.prefix OPERATOR(pg_catalog.=) p_prefix
       AND l.resource OPERATOR(pg_catalog.=) p_resource
       AND l.owner OPERATOR(pg_catalog.=) p_owner
       AND l.token OPERATOR(pg_catalog.=) p_token
    RETURNING l.expires_at INTO v_expires;
    IF FOUND THEN
        RETURN CASE WHEN v_expires OPERATOR(pg_catalog.>) clock_timestamp() THEN 1 ELSE 0 END;
    END IF;
    RETURN pgfence.issuer_not_held(p_prefix, p_resource);
END
$$;

-- Extends the lock to p_ttl_ms from now if the lease (owner and token) still holds it:
-- 1 held (extended), 0 expired (nobody holds it), -1 another lease holds it.
CREATE FUNCTION pgfence.issuer_extend(p_prefix text, p_resource text, p_owner text,
                                      p_token bigint, p_ttl_ms bigint) RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
BEGIN
    IF p_ttl_ms IS NULL THEN
        RAISE EXCEPTION 'pgfence: issuer_extend needs a TTL' USING ERRCODE = '22023';
    END IF;
    PERFORM pgfence.issuer_check_args(p_prefix, p_resource, p_owner, p_ttl_ms);
    UPDATE pgfence.issuer_lock l
       SET expires_at = clock_timestamp() OPERATOR(pg_catalog.+)
                        make_interval(secs => p_ttl_ms::double precision OPERATOR(pg_catalog./) 1000)
     WHERE l.prefix OPERATOR(pg_catalog.=) p_prefix
       AND l.resource OPERATOR(pg_catalog.=) p_resource
       AND l.owner OPERATOR(pg_catalog.=) p_owner
       AND l.token OPERATOR(pg_catalog.=) p_token
       AND l.expires_at OPERATOR(pg_catalog.>) clock_timestamp();
    IF FOUND THEN
        RETURN 1;
    END IF;
    RETURN pgfence.issuer_not_held(p_prefix, p_resource);
END
$$;

-- The lock and counter of p_resource: the holder's owner id, token and remaining ms (NULLs
-- when nobody holds it) and the counter's value (the last token issued; 0 when none).
CREATE FUNCTION pgfence.issuer_status(p_prefix text, p_resource text)
RETURNS TABLE (owner text, token bigint, ttl_ms bigint, counter bigint)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
BEGIN
    PERFORM pgfence.issuer_check_args(p_prefix, p_resource, NULL, NULL);
    RETURN QUERY
    SELECT l.owner, l.token,
           CASE WHEN l.expires_at IS NOT NULL THEN
               greatest(1, ceil(extract(epoch FROM l.expires_at OPERATOR(pg_catalog.-)
                                                    clock_timestamp())
                                OPERATOR(pg_catalog.*) 1000))::bigint
           END,
           coalesce((SELECT c.value FROM pgfence.issuer_counter c
                      WHERE c.prefix OPERATOR(pg_catalog.=) p_prefix
                        AND c.counter OPERATOR(pg_catalog.=) pgfence.issuer_counter_id(p_resource)),
                    0::bigint)
      FROM (SELECT 1) AS one
      LEFT JOIN pgfence.issuer_lock l
        ON l.prefix OPERATOR(pg_catalog.=) p_prefix
       AND l.resource OPERATOR(pg_catalog.=) p_resource
       AND l.expires_at OPERATOR(pg_catalog.>) clock_timestamp();
END
$$;

REVOKE ALL ON FUNCTION
    pgfence.issuer_counter_id(text),
    pgfence.issuer_check_args(text, text, text, bigint),
    pgfence.issuer_acquire(text, text, text, bigint),
    pgfence.issuer_not_held(text, text),
    pgfence.issuer_release(text, text, text, bigint),
    pgfence.issuer_extend(text, text, text, bigint, bigint),
    pgfence.issuer_status(text, text)
FROM PUBLIC;
