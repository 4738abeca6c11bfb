//! Real brokers for the consumer tests: the shared RabbitMQ and NATS
//! JetStream (a unique queue / stream per test), and private nats-server
//! instances on free ports for restart tests.
#![allow(dead_code, unreachable_pub)]

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use async_nats::jetstream;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use super::services::missing;

pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
pub const NATS_URL: &str = "nats://127.0.0.1:4222";

/// A queue of this test's own on the shared RabbitMQ, and a channel to
/// publish to it with confirms.
pub struct Queue {
    pub url: String,
    pub name: String,
    channel: Channel,
    _connection: Connection,
}

impl Queue {
    /// Declares a fresh durable queue on the shared RabbitMQ.
    pub async fn new(test: &str) -> Option<Queue> {
        let url = std::env::var("IDEMGATE_TEST_AMQP_URL").unwrap_or_else(|_| AMQP_URL.into());
        let name = format!("t.{test}.{}", uuid::Uuid::now_v7().simple());
        Queue::open(test, &url, &name).await
    }

    /// Connects to `url` and declares the durable queue `name` (again,
    /// after a broker restart).
    pub async fn open(test: &str, url: &str, name: &str) -> Option<Queue> {
        let (url, name) = (url.to_owned(), name.to_owned());
        let connect = Connection::connect(&url, ConnectionProperties::default());
        let connection = match tokio::time::timeout(Duration::from_secs(5), connect).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                missing("RabbitMQ", test, &e.to_string());
                return None;
            }
            Err(_) => {
                missing("RabbitMQ", test, "connect timed out");
                return None;
            }
        };
        let channel = connection.create_channel().await.unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        channel
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        Some(Queue {
            url,
            name,
            channel,
            _connection: connection,
        })
    }

    /// Publishes one persistent message, confirmed by the broker.
    pub async fn publish(&self, id: Option<&str>, body: &[u8], headers: &[(&str, &str)]) {
        let mut properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into());
        if let Some(id) = id {
            properties = properties.with_message_id(id.into());
        }
        if !headers.is_empty() {
            let mut table = FieldTable::default();
            for (k, v) in headers {
                table.insert(
                    (*k).into(),
                    AMQPValue::LongString(LongString::from(v.to_string())),
                );
            }
            properties = properties.with_headers(table);
        }
        self.publish_with(body, properties).await;
    }

    /// Publishes `body` with `properties` as they are, confirmed by the
    /// broker.
    async fn publish_with(&self, body: &[u8], properties: BasicProperties) {
        let confirm = self
            .channel
            .basic_publish(
                "".into(),
                self.name.as_str().into(),
                BasicPublishOptions::default(),
                body,
                properties,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack(), "the broker refused a test message");
    }

    /// Another queue on the same connection, declared with a dead-letter
    /// exchange (`exchange`, fanout) bound to the queue `dead`: a queue
    /// whose owner routes its dead letters.
    pub async fn declare_with_dead_letter_exchange(&self, exchange: &str, dead: &str) -> Queue {
        use lapin::options::{ExchangeDeclareOptions, QueueBindOptions};
        self.channel
            .exchange_declare(
                exchange.into(),
                lapin::ExchangeKind::Fanout,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        self.declare(dead).await;
        self.channel
            .queue_bind(
                dead.into(),
                exchange.into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let name = format!("{}.owned", self.name);
        let mut arguments = FieldTable::default();
        arguments.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(LongString::from(exchange.to_owned())),
        );
        self.channel
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions::durable(),
                arguments,
            )
            .await
            .unwrap();
        // Its own connection, without declaring it again (other arguments
        // would be refused).
        let connection = Connection::connect(&self.url, ConnectionProperties::default())
            .await
            .unwrap();
        let channel = connection.create_channel().await.unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        Queue {
            url: self.url.clone(),
            name,
            channel,
            _connection: connection,
        }
    }

    /// Publishes `id` as a quorum queue delivers a message the second
    /// time: with `x-delivery-count: 1` (an integer), which is how a
    /// redelivery is told apart from a fresh publish.
    pub async fn publish_redelivered(&self, id: &str, body: &[u8]) {
        let mut table = FieldTable::default();
        table.insert("x-delivery-count".into(), AMQPValue::LongLongInt(1));
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into())
            .with_message_id(id.into())
            .with_headers(table);
        self.publish_with(body, properties).await;
    }

    /// Publishes `message` (taken from another queue) to this queue with
    /// its properties and headers as they are: an operator moving a dead
    /// letter back.
    pub async fn republish(&self, message: &lapin::message::BasicGetMessage) {
        self.publish_with(&message.delivery.data, message.delivery.properties.clone())
            .await;
    }

    /// Messages ready in a queue (not those delivered and unacked).
    pub async fn ready(&self, queue: &str) -> u32 {
        // A channel of its own: a passive declare of a missing queue
        // closes the channel it is sent on.
        let channel = self._connection.create_channel().await.unwrap();
        let count = channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map(|q| q.message_count())
            .unwrap_or(0);
        let _ = channel.close(200, "".into()).await;
        count
    }

    /// Whether a queue exists (a passive declare on a channel of its own:
    /// a refusal closes the channel).
    pub async fn exists(&self, queue: &str) -> bool {
        let channel = self._connection.create_channel().await.unwrap();
        channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .is_ok()
    }

    /// Deletes a queue.
    pub async fn delete(&self, queue: &str) {
        self.channel
            .queue_delete(queue.into(), lapin::options::QueueDeleteOptions::default())
            .await
            .unwrap();
    }

    /// Declares a durable queue.
    pub async fn declare(&self, queue: &str) {
        self.channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await
            .unwrap();
    }

    /// Takes one message from a queue, if any (acknowledged).
    pub async fn take(&self, queue: &str) -> Option<lapin::message::BasicGetMessage> {
        self.channel
            .basic_get(
                queue.into(),
                lapin::options::BasicGetOptions { no_ack: true },
            )
            .await
            .unwrap()
    }

    /// The dead-letter queue's name.
    pub fn dlq(&self) -> String {
        format!("{}.dlq", self.name)
    }

    /// The consumer TOML for this queue.
    pub fn consumer(&self, name: &str, path: &str, extra: &str) -> String {
        consumer_toml(
            name,
            &self.url,
            &format!("queue = \"{}\"", self.name),
            path,
            extra,
        )
    }
}

/// `[[consumers]]` TOML.
pub fn consumer_toml(name: &str, source: &str, from: &str, path: &str, extra: &str) -> String {
    format!(
        r#"
        [[consumers]]
        name = "{name}"
        source = "{source}"
        {from}
        upstream = "demo"
        path = "{path}"
        retry_delay = "100ms"
        {extra}
        "#
    )
}

/// A stream of this test's own on a NATS server.
pub struct Stream {
    pub url: String,
    pub name: String,
    pub js: jetstream::Context,
}

impl Stream {
    /// A fresh file-backed stream on `subject.>` at `url` (the shared
    /// server when `None`).
    pub async fn new(test: &str, url: Option<&str>) -> Option<Stream> {
        let url = url.map(str::to_owned).unwrap_or_else(|| {
            std::env::var("IDEMGATE_TEST_NATS_URL").unwrap_or_else(|_| NATS_URL.into())
        });
        let connect = async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connect(url.as_str());
        let client = match tokio::time::timeout(Duration::from_secs(5), connect).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                missing("NATS", test, &e.to_string());
                return None;
            }
            Err(_) => {
                missing("NATS", test, "connect timed out");
                return None;
            }
        };
        let js = jetstream::new(client);
        let name = format!(
            "T_{}_{}",
            test.replace(['.', '-'], "_"),
            uuid::Uuid::now_v7().simple()
        );
        js.create_stream(jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![format!("{}.in.>", name.to_lowercase())],
            storage: jetstream::stream::StorageType::File,
            ..Default::default()
        })
        .await
        .unwrap();
        Some(Stream { url, name, js })
    }

    /// A subject the stream captures.
    pub fn subject(&self, topic: &str) -> String {
        format!("{}.in.{topic}", self.name.to_lowercase())
    }

    /// Publishes with headers, stored by JetStream.
    pub async fn publish(&self, topic: &str, headers: &[(&str, &str)], body: &[u8]) {
        let mut map = async_nats::HeaderMap::new();
        for (k, v) in headers {
            map.insert(*k, *v);
        }
        self.js
            .publish_with_headers(
                self.subject(topic),
                map,
                bytes::Bytes::copy_from_slice(body),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// Messages stored in the dead-letter stream.
    pub async fn dead_letters(&self) -> u64 {
        match self.js.get_stream(format!("{}_dlq", self.name)).await {
            Ok(mut s) => s.info().await.map(|i| i.state.messages).unwrap_or(0),
            Err(_) => 0,
        }
    }

    /// The consumer TOML for this stream.
    pub fn consumer(&self, name: &str, path: &str, extra: &str) -> String {
        consumer_toml(
            name,
            &self.url,
            &format!("stream = \"{}\"\n        durable = \"{name}\"", self.name),
            path,
            extra,
        )
    }
}

/// A nats-server of this test's own, with JetStream on a file store that
/// survives its restarts.
pub struct PrivateNats {
    pub port: u16,
    store: tempfile::TempDir,
    child: Option<Child>,
}

impl PrivateNats {
    pub async fn start(test: &str) -> Option<PrivateNats> {
        if Command::new("nats-server")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_err()
        {
            missing("nats-server", test, "not installed");
            return None;
        }
        let port = super::dead_port();
        let mut nats = PrivateNats {
            port,
            store: tempfile::tempdir().unwrap(),
            child: None,
        };
        nats.spawn().await;
        Some(nats)
    }

    async fn spawn(&mut self) {
        let child = Command::new("nats-server")
            .args([
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-sd",
            ])
            .arg(self.store.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let up = super::eventually(Duration::from_secs(10), || async {
            tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                .await
                .is_ok()
        })
        .await;
        assert!(up, "private nats-server did not come up");
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL) and starts it again on the same port and
    /// store, after `down`.
    pub async fn restart(&mut self, down: Duration) {
        self.kill();
        tokio::time::sleep(down).await;
        self.spawn().await;
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A RabbitMQ node of this test's own (its own ports, data and node name),
/// for broker restarts. The data directory outlives a restart: durable
/// queues and persistent messages come back.
pub struct PrivateRabbit {
    pub port: u16,
    dist_port: u16,
    node: String,
    dir: tempfile::TempDir,
    pid: Option<u32>,
    /// The `rabbitmq-server` wrapper (the node is its child).
    wrapper: Option<Child>,
}

impl PrivateRabbit {
    pub async fn start(test: &str) -> Option<PrivateRabbit> {
        if Command::new("sh")
            .args(["-c", "command -v rabbitmq-server"])
            .stdout(Stdio::null())
            .status()
            .map_or(true, |s| !s.success())
        {
            missing("rabbitmq-server", test, "not installed");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let (port, dist_port) = (super::dead_port(), super::dead_port());
        std::fs::write(dir.path().join("enabled_plugins"), "[].\n").unwrap();
        std::fs::write(
            dir.path().join("rabbitmq.conf"),
            format!("listeners.tcp.local = 127.0.0.1:{port}\nloopback_users = none\n"),
        )
        .unwrap();
        // rabbitmq-server runs the node as the rabbitmq user.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let mut rabbit = PrivateRabbit {
            port,
            dist_port,
            node: format!(
                "t{}@localhost",
                &uuid::Uuid::new_v4().simple().to_string()[..10]
            ),
            dir,
            pid: None,
            wrapper: None,
        };
        if !rabbit.spawn().await {
            missing("RabbitMQ (private node)", test, "did not start within 60 s");
            return None;
        }
        Some(rabbit)
    }

    async fn spawn(&mut self) -> bool {
        let d = self.dir.path();
        let _ = std::fs::remove_file(d.join("pid"));
        let wrapper = Command::new("rabbitmq-server")
            .env("RABBITMQ_CONFIG_FILE", d.join("rabbitmq.conf"))
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_FEATURE_FLAGS_FILE", d.join("feature_flags"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("enabled_plugins"))
            .env("RABBITMQ_PID_FILE", d.join("pid"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap();
        self.wrapper = Some(wrapper);
        let port = self.port;
        let up = super::eventually(Duration::from_secs(60), || async move {
            let url = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
            Connection::connect(&url, ConnectionProperties::default())
                .await
                .is_ok()
        })
        .await;
        self.pid = std::fs::read_to_string(d.join("pid"))
            .ok()
            .and_then(|p| p.trim().parse().ok());
        up
    }

    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// Kills the node (SIGKILL) and starts it again on the same ports and
    /// data.
    pub async fn restart(&mut self) {
        self.kill();
        tokio::time::sleep(Duration::from_millis(500)).await;
        if self.spawn().await {
            return;
        }
        // A node restarted on a loaded machine now and then never opens its
        // listener (seen once in CI); the test is about what the consumer
        // does across the outage, so a second start is still that test.
        eprintln!("the private RabbitMQ did not come back within 60 s; starting it again");
        self.kill();
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(self.spawn().await, "the private RabbitMQ did not come back");
    }

    pub fn kill(&mut self) {
        if let Some(pid) = self.pid.take() {
            // The node's own process only: never a group or a pattern.
            let _ = Command::new("kill")
                .args(["-s", "KILL", &pid.to_string()])
                .status();
            for _ in 0..50 {
                let gone = !Path::new(&format!("/proc/{pid}")).exists();
                if gone {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        if let Some(mut wrapper) = self.wrapper.take() {
            let _ = wrapper.kill();
            let _ = wrapper.wait();
        }
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A stream of this test's own on a Redis server (the shared one unless
/// `url` says otherwise).
pub struct RedisStream {
    pub url: String,
    pub name: String,
    client: redis::Client,
}

impl RedisStream {
    /// A fresh stream name on the shared Redis (or `url`), or `None` after
    /// saying by name that `test` was skipped.
    pub async fn new(test: &str, url: Option<&str>) -> Option<RedisStream> {
        let url = url.map(str::to_owned).unwrap_or_else(|| {
            std::env::var("IDEMGATE_TEST_REDIS_URL")
                .unwrap_or_else(|_| "redis://127.0.0.1:6379/".into())
        });
        let client = redis::Client::open(url.as_str()).unwrap();
        let reachable = tokio::time::timeout(
            Duration::from_secs(3),
            client.get_multiplexed_async_connection(),
        )
        .await
        .is_ok_and(|c| c.is_ok());
        if !reachable {
            super::services::missing("Redis", test, "cannot connect");
            return None;
        }
        Some(RedisStream {
            name: format!("t.{test}.{}", uuid::Uuid::now_v7().simple()),
            url,
            client,
        })
    }

    async fn conn(&self) -> redis::aio::MultiplexedConnection {
        self.client
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }

    /// `XADD` an entry with these fields; its id.
    pub async fn add(&self, fields: &[(&str, &str)]) -> String {
        let mut add = redis::cmd("XADD");
        add.arg(&self.name).arg("*");
        for (k, v) in fields {
            add.arg(*k).arg(*v);
        }
        add.query_async(&mut self.conn().await).await.unwrap()
    }

    /// Whether the stream exists (the gateway created it with its group).
    pub async fn exists(&self) -> bool {
        let n: i64 = redis::cmd("EXISTS")
            .arg(&self.name)
            .query_async(&mut self.conn().await)
            .await
            .unwrap();
        n == 1
    }

    /// Deletes the stream (its groups with it) and adds `orders` (one
    /// entry each, `order_id` and a body) to a new one, atomically: what a
    /// Redis restarted without persistence looks like to a consumer whose
    /// producers go on.
    pub async fn recreate_with(&self, orders: &[&str]) {
        let mut pipe = redis::pipe();
        pipe.atomic().cmd("DEL").arg(&self.name).ignore();
        for order in orders {
            pipe.cmd("XADD")
                .arg(&self.name)
                .arg("*")
                .arg("order_id")
                .arg(*order)
                .arg("body")
                .arg("{}")
                .ignore();
        }
        let () = pipe.query_async(&mut self.conn().await).await.unwrap();
    }

    /// `XCLAIM`s entry `id` for `consumer` regardless of its idle time: another
    /// instance taking it over.
    pub async fn steal(&self, group: &str, consumer: &str, id: &str) {
        let _: redis::Value = redis::cmd("XCLAIM")
            .arg(&self.name)
            .arg(group)
            .arg(consumer)
            .arg(0)
            .arg(id)
            .arg("JUSTID")
            .query_async(&mut self.conn().await)
            .await
            .unwrap();
    }

    /// Adds `consumer` to `group` (`XGROUP CREATECONSUMER`).
    pub async fn create_consumer(&self, group: &str, consumer: &str) {
        let _: i64 = redis::cmd("XGROUP")
            .arg("CREATECONSUMER")
            .arg(&self.name)
            .arg(group)
            .arg(consumer)
            .query_async(&mut self.conn().await)
            .await
            .unwrap();
    }

    /// The names of `group`'s consumers.
    pub async fn consumers(&self, group: &str) -> Vec<String> {
        let reply: redis::streams::StreamInfoConsumersReply = redis::cmd("XINFO")
            .arg("CONSUMERS")
            .arg(&self.name)
            .arg(group)
            .query_async(&mut self.conn().await)
            .await
            .unwrap();
        reply.consumers.into_iter().map(|c| c.name).collect()
    }

    /// The consumer that owns pending entry `id`, if it is pending.
    pub async fn owner(&self, group: &str, id: &str) -> Option<String> {
        let reply: redis::Value = redis::cmd("XPENDING")
            .arg(&self.name)
            .arg(group)
            .arg(id)
            .arg(id)
            .arg(1)
            .query_async(&mut self.conn().await)
            .await
            .unwrap();
        match reply {
            redis::Value::Array(items) => match items.first() {
                Some(redis::Value::Array(entry)) => match entry.get(1) {
                    Some(redis::Value::BulkString(b)) => {
                        Some(String::from_utf8_lossy(b).into_owned())
                    }
                    _ => None,
                },
                _ => None,
            },
            _ => None,
        }
    }

    /// Entries delivered to the group and not acknowledged.
    pub async fn pending(&self, group: &str) -> u64 {
        let reply: redis::Value = redis::cmd("XPENDING")
            .arg(&self.name)
            .arg(group)
            .query_async(&mut self.conn().await)
            .await
            .unwrap_or(redis::Value::Nil);
        match reply {
            redis::Value::Array(items) => match items.first() {
                Some(redis::Value::Int(n)) => *n as u64,
                _ => 0,
            },
            _ => 0,
        }
    }

    /// The dead-letter stream's entries, each as its fields.
    pub async fn dead_letters(&self) -> Vec<std::collections::BTreeMap<String, String>> {
        let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(format!("{}.dlq", self.name))
            .arg("-")
            .arg("+")
            .query_async(&mut self.conn().await)
            .await
            .unwrap();
        reply
            .ids
            .iter()
            .map(|id| {
                id.map
                    .iter()
                    .map(|(k, v)| {
                        let text = match v {
                            redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                            other => format!("{other:?}"),
                        };
                        (k.clone(), text)
                    })
                    .collect()
            })
            .collect()
    }

    /// The consumer TOML for this stream.
    pub fn consumer(&self, name: &str, path: &str, extra: &str) -> String {
        consumer_toml(
            name,
            &self.url,
            &format!("stream = \"{}\"\ngroup = \"g\"", self.name),
            path,
            extra,
        )
    }

    /// Deletes the stream and its dead letters.
    pub async fn delete(&self) {
        let _: Result<(), _> = redis::cmd("DEL")
            .arg(&self.name)
            .arg(format!("{}.dlq", self.name))
            .query_async(&mut self.conn().await)
            .await;
    }
}
