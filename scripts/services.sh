#!/usr/bin/env bash
# Makes sure the services the service-backed tests use are up: PostgreSQL on
# 127.0.0.1:5432 (database `test`, user `postgres`), MariaDB on
# 127.0.0.1:3306 (database `test`, user `root`), Redis on
# 127.0.0.1:6379, RabbitMQ on 127.0.0.1:5672 (guest/guest), NATS with
# JetStream on 127.0.0.1:4222, and that the faketime and nginx tools are installed. Starts each one that is installed but down. Never fails by
# itself: a service that cannot be started makes its tests skip loudly (or
# fail, with CI=true).
set -u

pg_up() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }
redis_up() { redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; }

if ! pg_up; then
  if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
    echo "services: starting PostgreSQL"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
    for _ in $(seq 1 30); do pg_up && break; sleep 0.5; done
  fi
fi
if pg_up; then
  psql -h 127.0.0.1 -U postgres -tc "SELECT 1 FROM pg_database WHERE datname='test'" 2>/dev/null | grep -q 1 \
    || psql -h 127.0.0.1 -U postgres -c "CREATE DATABASE test" >/dev/null 2>&1 || true
  echo "services: PostgreSQL up"
else
  echo "services: PostgreSQL NOT available on 127.0.0.1:5432"
fi

if ! redis_up; then
  if command -v redis-server >/dev/null 2>&1; then
    echo "services: starting Redis"
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null || true
    for _ in $(seq 1 30); do redis_up && break; sleep 0.2; done
  fi
fi
if redis_up; then
  echo "services: Redis up"
else
  echo "services: Redis NOT available on 127.0.0.1:6379"
fi
tcp_up() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# MariaDB on 127.0.0.1:3306 (root, no password, database `test`): the
# MySQL store's conformance and end-to-end runs (IDEMGATE_TEST_SQL=mariadb).
mariadb_up() { mariadb-admin -h 127.0.0.1 -P 3306 -u root ping >/dev/null 2>&1; }
if ! mariadb_up && [ -x /etc/init.d/mariadb ]; then
  echo "services: starting MariaDB"
  /etc/init.d/mariadb start >/dev/null 2>&1 || true
  for _ in $(seq 1 60); do mariadb_up && break; sleep 0.5; done
fi
if mariadb_up; then
  mariadb -h 127.0.0.1 -u root -e "CREATE DATABASE IF NOT EXISTS test" >/dev/null 2>&1 || true
  echo "services: MariaDB up"
else
  echo "services: MariaDB NOT available on 127.0.0.1:3306"
fi
if ! tcp_up 5672 && command -v rabbitmq-server >/dev/null 2>&1; then
  echo "services: starting RabbitMQ"
  setsid nohup rabbitmq-server >/tmp/rabbitmq-server.log 2>&1 < /dev/null &
  for _ in $(seq 1 60); do tcp_up 5672 && break; sleep 0.5; done
fi
tcp_up 5672 && echo "services: RabbitMQ up" || echo "services: RabbitMQ NOT available on 127.0.0.1:5672"
if ! tcp_up 4222 && command -v nats-server >/dev/null 2>&1; then
  echo "services: starting NATS (JetStream)"
  mkdir -p /tmp/nats-js
  setsid nohup nats-server -js -a 127.0.0.1 -p 4222 -sd /tmp/nats-js >/tmp/nats-server.log 2>&1 < /dev/null &
  for _ in $(seq 1 30); do tcp_up 4222 && break; sleep 0.2; done
fi
tcp_up 4222 && echo "services: NATS up" || echo "services: NATS NOT available on 127.0.0.1:4222"
# faketime runs a gateway with its wall clock moved (the clock-skew test).
if ! command -v faketime >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "services: installing faketime"
  DEBIAN_FRONTEND=noninteractive apt-get install -y faketime >/dev/null 2>&1 \
    || { apt-get update >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y faketime >/dev/null 2>&1; } || true
fi
command -v faketime >/dev/null 2>&1 && echo "services: faketime available" || echo "services: faketime NOT available"
# nginx stands between the gateway and the demo service in the ingress
# tests (tests/suite/ingress.rs): its 502/504 for an answer it lost. Only
# the binary: the tests run private instances; the package must not start
# one of its own on port 80 (policy-rc.d refuses that while it installs).
nginx_bin() { [ -x /usr/sbin/nginx ] || command -v nginx >/dev/null 2>&1; }
if ! nginx_bin && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "services: installing nginx"
  had_policy=0; [ -e /usr/sbin/policy-rc.d ] && had_policy=1
  [ "$had_policy" = 1 ] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y nginx-light >/dev/null 2>&1 \
    || { apt-get update >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y nginx-light >/dev/null 2>&1; } || true
  [ "$had_policy" = 1 ] || rm -f /usr/sbin/policy-rc.d
fi
nginx_bin && echo "services: nginx available" || echo "services: nginx NOT available"
# The Galera tests (tests/suite/galera.rs) start a private three-node
# cluster: the provider library and rsync (its state transfer).
galera_ok() { [ -e /usr/lib/galera/libgalera_smm.so ] && command -v rsync >/dev/null 2>&1; }
if ! galera_ok && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "services: installing galera-4 and rsync"
  DEBIAN_FRONTEND=noninteractive apt-get install -y galera-4 rsync >/dev/null 2>&1 \
    || { apt-get update >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y galera-4 rsync >/dev/null 2>&1; } || true
fi
galera_ok && echo "services: galera available" || echo "services: galera NOT available"
exit 0
