"""A real Apache Kafka broker on 127.0.0.1: KRaft mode, one node (broker and controller), from
Maven Central's ``org.apache.kafka:kafka_2.13`` and its dependencies plus an SLF4J binding, run
on the machine's Java 17. What the suite, ``icebarrier check --kafka``, ``benchmarks/kafka.py``
and the Kafka example run against; a production pipeline points at its own brokers instead.

The jars are fetched once by ``mvn dependency:copy-dependencies`` (honouring the user's
``settings.xml``) into ``~/.cache/icebarrier/kafka/<version>/libs``, every file's SHA-256 checked
against the list pinned here before each start (a stamp records a verified set). The first fetch
and a start are measured in the README.

    python -m icebarrier.apps.kafka_broker       # fetch and verify the jars now (.ci/run does)

    with kafka_broker(tmp_path) as broker:
        broker.bootstrap                          # "127.0.0.1:<port>"
        broker.stop(); broker.start()             # the same log, restarted
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from icebarrier.apps.embedded import free_port
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.iceberg_ext import config

VERSION = "3.9.1"
SCALA = "2.13"
SLF4J_BINDING = ("org.slf4j", "slf4j-reload4j", "1.7.36")
JARS_ENV = "ICEBARRIER_KAFKA_LIBS"  # a directory of Kafka's jars to use as they are (not verified)
START_TIMEOUT_S = 60.0

# Every jar `mvn dependency:copy-dependencies` brings for kafka_2.13:3.9.1 + slf4j-reload4j:1.7.36.
JARS = {
    "argparse4j-0.7.0.jar": "65ceb669d88f63306c680f8088bbf765bbca72d288a61a03703000076c3d3f56",
    "audience-annotations-0.12.0.jar": "ffb101fc066360ff3c77457c927fd7967fb096a6ee9e046ab7071447d8208efc",
    "caffeine-2.9.3.jar": "1e0a7bbef1dd791653143f3f05d0e489934bf5481e58a87c9e619cd46b68729b",
    "commons-beanutils-1.9.4.jar": "7d938c81789028045c08c065e94be75fc280527620d5bd62b519d5838532368a",
    "commons-cli-1.4.jar": "fd3c7c9545a9cdb2051d1f9155c4f76b1e4ac5a57304404a6eedb578ffba7328",
    "commons-collections-3.2.2.jar": "eeeae917917144a68a741d4c0dff66aa5c5c5fd85593ff217bced3fc8ca783b8",
    "commons-digester-2.1.jar": "e0b2b980a84fc6533c5ce291f1917b32c507f62bcad64198fff44368c2196a3d",
    "commons-io-2.14.0.jar": "e35d1df7232568ed4b81d9a9ed94a0159b3ff6cf1915cc21eef5cb55d7b157a2",
    "commons-logging-1.2.jar": "daddea1ea0be0f56978ab3006b8ac92834afeefbd9b7e4e6316fca57df0fa636",
    "commons-validator-1.7.jar": "4d74f4ce4fb68b2617edad086df6defdf9338467d2377d2c62e69038e1c4f02f",
    "error_prone_annotations-2.10.0.jar": "a249d4d25dfb86d41e6c82fc335df580189f0c9feeabdc53233fc1e5060724a1",
    "jackson-annotations-2.16.2.jar": "d1cdd269ebaa753d1842933194e17d61958f058952d63e03dbfb3d1d78a6926e",
    "jackson-core-2.16.2.jar": "4f43e2f1430b2d2413e8e5a3d79138e57e891d6a961b18c28ac90859639d8664",
    "jackson-databind-2.16.2.jar": "53b6025d98c357068296e4b134242443a248c2c582800879f1c4ea93b54bafa6",
    "jackson-dataformat-csv-2.16.2.jar": "01a04610def154c50369e8bcd7c5ae1401579f591aa55e88f05093447e24d490",
    "jackson-datatype-jdk8-2.16.2.jar": "3e9b1b59f638b487b5ae0e2f4190fc98f72b0bf661324e7dfc71a69f6b9d4e29",
    "jackson-module-scala_2.13-2.16.2.jar": "1154f6dc8643739c0c3ef4c2a7901ca752b5cca7ebe1908d405ced701a8f3764",
    "jopt-simple-5.0.4.jar": "df26cc58f235f477db07f753ba5a3ab243ebe5789d9f89ecf68dd62ea9a66c28",
    "jose4j-0.9.4.jar": "9012aa4c20319d35159030c3bdecade66863030a98338bfdf73a5238849fb9d9",
    "kafka-clients-3.9.1.jar": "7568b998572d256f0b7bc0afdc1b7a2588b8b08415c62ce314c864a6851ae9d9",
    "kafka-group-coordinator-3.9.1.jar": "fd30310533df51b17d14beb8eb8c9006a9ebb90b536c319776429e413f622a69",
    "kafka-group-coordinator-api-3.9.1.jar": "cb267d841def1172d8db24a830936f1c6aaf29c3de5bdbc5bbc42b67d8cb82c0",
    "kafka-metadata-3.9.1.jar": "35c35118d4abb0b747ad68d1e0be00d5bd02206b462ad76ebbcd85b33436f13a",
    "kafka-raft-3.9.1.jar": "0d4236cf868f8668c74c49bec4bed41e400bb13d6d381a0f8e9843585b2f159f",
    "kafka-server-3.9.1.jar": "02b5a92645865e3152e9d1d829f6d4c4b4272f637b7fe4a2b00cabcbcd8df6f4",
    "kafka-server-common-3.9.1.jar": "99f1f5f81e9d39cfbe5c96ab8e3854be8deca465937192c9a6e2f231678d31f6",
    "kafka-storage-3.9.1.jar": "a3041e6192a37e5508519d776f8af93b74d3fd23174b03e270c0394f1c77b59f",
    "kafka-storage-api-3.9.1.jar": "f466777625641d4bca1314d80206eafa9e2494326496ad626489ba0a0ef479fc",
    "kafka-tools-api-3.9.1.jar": "c365c872ffc9a04886f248c5fd90067829ed4064fcd8fe5e12611b163cd053b4",
    "kafka-transaction-coordinator-3.9.1.jar": "45b852f2e6e501d4dbdd43b97c4057e6cb6827b76e5aabcffcae8b8e2918554f",
    "kafka_2.13-3.9.1.jar": "5631c61356d55611c158291a69ad028f3c4fed5d0a610c62a0853c65c89d10f6",
    "lz4-java-1.8.0.jar": "d74a3334fb35195009b338a951f918203d6bbca3d1d359033dc33edd1cadc9ef",
    "metrics-core-2.2.0.jar": "6b7a14a6f34c10f8683f7b5e2f39df0f07b58c7dff0e468ebbc713905c46979c",
    "metrics-core-4.1.12.1.jar": "cec34936faa625039f4e46123eccaa10a9eb9d9a40c6075830cd81330e259cf9",
    "netty-buffer-4.1.105.Final.jar": "cc1b0108a60b1eb69bd01a10922851a166c58972cc0683f2116a9e8e7ecdaf0b",
    "netty-codec-4.1.105.Final.jar": "c4f62480b408fb835b454c74cf6394a4c7088ffdaec78742fcece816c46bb58e",
    "netty-common-4.1.105.Final.jar": "399a8045fb43861afb7fc1ef3371f95a0b176692fb268f4867cff4957e63fd25",
    "netty-handler-4.1.105.Final.jar": "5a6945cf1de374628b37ab1c35a4c47c2f5616db3a94b150720641477112be8e",
    "netty-resolver-4.1.105.Final.jar": "7202edd076a1edab50fdb0f3e54f56a02129b326296d9f35f4194f8cfb9b96ef",
    "netty-transport-4.1.105.Final.jar": "be9b8a2f86685a876e469c904cb9fce53a1e826e178d44d2b1d92f6a99054737",
    "netty-transport-classes-epoll-4.1.105.Final.jar": "a43bf94f784eb759c14f0b0c7e1c5985a64879e8c7ab21ba7c0c80f7a9382b30",
    "netty-transport-native-epoll-4.1.105.Final.jar": "61f09ce16f0fd25e57a0a732f8fb79344f6b95051d88ac50a28874ad92e6d149",
    "netty-transport-native-unix-common-4.1.105.Final.jar": "7db91b72aae19e1cdca13c7fa76d57db20cbaf5b1e770563909a4437c63eb5cb",
    "paranamer-2.8.jar": "688cb118a6021d819138e855208c956031688be4b47a24bb615becc63acedf07",
    "pcollections-4.0.1.jar": "1f82766d7c3221930854033bebff5073ea46b43f27326074bbe15d148c18bfb3",
    "reload4j-1.2.19.jar": "fa07aa7adedf2a65eb09007443bb60b51c725b1b5b88e481e00c529ff2d3b5b5",
    "scala-collection-compat_2.13-2.10.0.jar": "bb10091bd55131a5327bdeddede74e5d8a695acab24a97567111784f2f427299",
    "scala-java8-compat_2.13-1.0.2.jar": "90d5b13656be93fb779b8d7c723efa2498a34af06273bb5204afb65f85a20c1b",
    "scala-library-2.13.15.jar": "8e4dbc3becf70d59c787118f6ad06fab6790136a0699cd6412bc9da3d336944e",
    "scala-logging_2.13-3.9.5.jar": "87a3017d3f43e6ace7566fe4c3d615134c6914ff871c8d64bb32ca1d996d0545",
    "scala-reflect-2.13.15.jar": "78d0cc350e1ee42d87c6e11cf5b0dc7bf0b70829c00aa38f27bfb019d439dc11",
    "slf4j-api-1.7.36.jar": "d3ef575e3e4979678dc01bf1dcce51021493b4d11fb7f1be8ad982877c16a1c0",
    "slf4j-reload4j-1.7.36.jar": "ae6fdd5c9547896114d5ec7fa7503733b7d2890573d3886fb548b3119c4d3f67",
    "snappy-java-1.1.10.5.jar": "0f3f1857ed33116583f480b4df5c0218836c47bfbc9c6221c0d73f356decf37b",
    "zookeeper-3.8.4.jar": "2d77b152039e7f85dc5438a9304febff86a2f3e55c88976a8be309af39028e97",
    "zookeeper-jute-3.8.4.jar": "93e854b55d731e745bafec187e2e7bf3389fd2a88e2fc8d1a3c1b9110284b284",
    "zstd-jni-1.5.6-4.jar": "793ca8734aa15687e7e64564eab8b6ae9ee2720eae27aa663074682144b1c386",
}


class KafkaUnavailableError(IcebarrierError):
    """The pinned Kafka broker cannot be fetched, verified or started here."""


def cache_dir() -> Path:
    return config.cache_dir("kafka", VERSION)


def libs() -> Path:
    """The directory of the broker's jars: fetched once (under a lock), verified."""
    if os.environ.get(JARS_ENV):
        return Path(os.environ[JARS_ENV])
    home = cache_dir()
    home.mkdir(parents=True, exist_ok=True)
    target = home / "libs"
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_dir():
            _fetch(home, target)
        _verify(target)
    return target


def _pom() -> str:
    group, artifact, version = SLF4J_BINDING
    return f"""<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>icebarrier</groupId><artifactId>kafka-broker</artifactId><version>{VERSION}</version>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_{SCALA}</artifactId><version>{VERSION}</version></dependency>
    <dependency><groupId>{group}</groupId><artifactId>{artifact}</artifactId><version>{version}</version></dependency>
  </dependencies>
</project>
"""


def _fetch(home: Path, target: Path) -> None:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaUnavailableError(
            f"Kafka {VERSION}'s jars are not cached in {target} and `mvn` is not installed (apt-get install maven)"
        )
    partial = home / "libs.partial"
    shutil.rmtree(partial, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "pom.xml").write_text(_pom())
        cmd = [mvn, "-B", "-q", "-f", str(Path(tmp) / "pom.xml"), "dependency:copy-dependencies"]
        done = subprocess.run(
            [*cmd, f"-DoutputDirectory={partial}", "-DincludeScope=runtime"],
            capture_output=True,
            text=True,
            timeout=1800,
        )
    if done.returncode != 0:
        reason = next((line for line in done.stdout.splitlines() if "ERROR" in line), done.stderr.strip()[-300:])
        raise KafkaUnavailableError(f"mvn could not fetch Kafka {VERSION}'s jars: {reason[:300]}")
    partial.rename(target)


def _verify(target: Path) -> None:
    present = {p.name: p for p in target.glob("*.jar")}
    if set(present) != set(JARS):
        extra, missing = sorted(set(present) - set(JARS)), sorted(set(JARS) - set(present))
        raise KafkaUnavailableError(
            f"{target} does not hold Kafka {VERSION}'s pinned jars (missing {missing[:3]}, unexpected "
            f"{extra[:3]}); delete the directory, the next start fetches it again"
        )
    stamp = target / ".verified"
    marks = "".join(
        f"{n} {p.stat().st_ino} {p.stat().st_size} {p.stat().st_mtime_ns}\n" for n, p in sorted(present.items())
    )
    if stamp.is_file() and stamp.read_text() == marks:
        return
    for name, path in sorted(present.items()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != JARS[name]:
            raise KafkaUnavailableError(
                f"{path} has SHA-256 {digest}, not the pinned {JARS[name]}; delete {target}, the next start fetches it again"
            )
    stamp.write_text(marks)


def java() -> str:
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if not found:
        raise KafkaUnavailableError(
            "Kafka needs Java 17 or newer; install a JDK (apt-get install openjdk-17-jre-headless)"
        )
    return found


class Broker:
    """One KRaft node whose log lives in ``work``; ``start`` and ``stop`` it as often as wanted."""

    def __init__(self, work: Path, *, partitions: int = 1, properties: dict[str, str] | None = None) -> None:
        self.work = Path(work)
        self.port, self.controller_port = free_port(), free_port()
        self.partitions = partitions
        self.extra = dict(properties or {})
        self.process: subprocess.Popen | None = None
        self.log_file = self.work / "broker.log"
        self._libs = libs()
        self._configure()

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _configure(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        properties = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.work / "log"),
            "num.partitions": str(self.partitions),
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "1",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",
            **self.extra,
        }
        self.config = self.work / "server.properties"
        self.config.write_text("".join(f"{k}={v}\n" for k, v in properties.items()))
        if (self.work / "log" / "meta.properties").exists():  # formatted before: the same log, restarted
            return
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        self._run_tool(
            "kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}", "-c", str(self.config)
        )  # "=": an id may begin with "-"

    def _command(self, main: str, *args: str) -> list[str]:
        log4j = self.work / "log4j.properties"
        if not log4j.exists():
            log4j.write_text(
                "log4j.rootLogger=WARN, stderr\nlog4j.appender.stderr=org.apache.log4j.ConsoleAppender\n"
                "log4j.appender.stderr.Target=System.err\nlog4j.appender.stderr.layout=org.apache.log4j.PatternLayout\n"
                "log4j.appender.stderr.layout.ConversionPattern=[%d] %p %m (%c)%n\n"
            )
        return [
            java(),
            "-Xms256m",
            "-Xmx512m",
            "-XX:+UseSerialGC",
            # the C1 compiler only: a local broker's start 5.5 -> 3.6 CPU-s, idle 2.2 -> 1.6 CPU-s a
            # minute (measured here, 2026-12-03); its load is tests' and examples', not a cluster's
            "-XX:TieredStopAtLevel=1",
            f"-Dlog4j.configuration=file:{log4j}",
            "-cp",
            f"{self._libs}/*",
            main,
            *args,
        ]

    def _run_tool(self, main: str, *args: str) -> None:
        done = subprocess.run(self._command(main, *args), capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise KafkaUnavailableError(f"Kafka's {main} failed: {(done.stderr or done.stdout).strip()[-500:]}")

    def start(self) -> Broker:
        if self.process is not None and self.process.poll() is None:
            return self
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(
                self._command("kafka.Kafka", str(self.config)),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise KafkaUnavailableError(f"Kafka exited with {self.process.returncode}; see {self.log_file}")
            if self._answers():
                return self
            time.sleep(0.1)
        self.stop()
        raise KafkaUnavailableError(
            f"Kafka did not answer on {self.bootstrap} in {START_TIMEOUT_S:g} s; see {self.log_file}"
        )

    def _answers(self) -> bool:
        from confluent_kafka.admin import AdminClient

        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
        except OSError:
            return False
        admin = AdminClient({"bootstrap.servers": self.bootstrap, "socket.timeout.ms": 2000})
        try:
            return bool(admin.list_topics(timeout=2).brokers)
        except Exception:
            return False

    def stop(self, *, kill: bool = False) -> None:
        """Stop the broker (SIGTERM, a clean shutdown; ``kill``: SIGKILL) and wait for it."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def create_topic(self, topic: str, *, partitions: int = 1, config: dict[str, str] | None = None) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        futures = admin.create_topics(
            [NewTopic(topic, num_partitions=partitions, replication_factor=1, config=dict(config or {}))]
        )
        for future in futures.values():  # admin is kept alive until they resolve
            future.result(timeout=30)

    def add_partitions(self, topic: str, total: int) -> None:
        from confluent_kafka.admin import AdminClient, NewPartitions

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        for future in admin.create_partitions([NewPartitions(topic, total)]).values():
            future.result(timeout=30)


@contextlib.contextmanager
def kafka_broker(work: Path, **kwargs) -> Iterator[Broker]:
    broker = Broker(work, **kwargs).start()
    try:
        yield broker
    finally:
        broker.stop()


def main() -> None:
    started = time.monotonic()
    print(f"Kafka {VERSION}: jars in {libs()} ({time.monotonic() - started:.1f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
