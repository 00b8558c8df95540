#!/bin/sh
# First start: initdb with the password from POSTGRES_PASSWORD (scram, over TCP only), then the
# user and database; every start: exec the command (`postgres` plus any arguments).
set -eu
: "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
user="${POSTGRES_USER:-postgres}"
db="${POSTGRES_DB:-$user}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
  # UTF8 as the official image has it (a C-locale initdb gives SQL_ASCII, which psycopg
  # returns as bytes)
  initdb --username="$user" --pwfile="$pwfile" --auth-host=scram-sha-256 --auth-local=trust \
    --encoding=UTF8 --locale=C.UTF-8 \
    -D "$PGDATA" >/dev/null
  rm -f "$pwfile"
  if [ "$db" != "postgres" ]; then
    # a socket-only server for the one statement: nothing can connect over TCP meanwhile
    pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
    psql -v ON_ERROR_STOP=1 --username="$user" --dbname=postgres \
      -c "CREATE DATABASE \"$db\" OWNER \"$user\"" >/dev/null
    pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
  fi
fi
if [ "${1:-}" = "postgres" ]; then
  shift
  exec postgres -D "$PGDATA" "$@"
fi
exec "$@"
