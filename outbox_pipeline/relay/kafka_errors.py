"""What a Kafka error says about the record it failed (`FailureKind`: permanent, record or transport), which decides
what the failure costs: a broker's maintenance window must never turn into dead letters. See
docs/strategies.md#failures."""

from __future__ import annotations

from confluent_kafka import KafkaError

from ..model import FailureKind

# Errors no retry can fix: the record itself is unacceptable (too large, invalid topic name).
PERMANENT_ERRORS = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.TOPIC_EXCEPTION,
        KafkaError.INVALID_MSG,
        KafkaError.INVALID_RECORD,
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError._INVALID_ARG,
    }
)


# Errors after which this producer instance is of no further use (its id or epoch is rejected).
PRODUCER_RESET_ERRORS = frozenset(
    {
        KafkaError.PRODUCER_FENCED,
        KafkaError._FENCED,
        KafkaError.INVALID_PRODUCER_EPOCH,
        KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
        KafkaError.UNKNOWN_PRODUCER_ID,
        KafkaError.INVALID_PRODUCER_ID_MAPPING,
    }
)


# Errors that say the broker or the path to it is unavailable, slow or has fenced this producer: no
# fault of the record, so they never count toward its attempts (see FailureKind).
TRANSPORT_ERRORS = PRODUCER_RESET_ERRORS | frozenset(
    {
        KafkaError._MSG_TIMED_OUT,
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._RESOLVE,
        KafkaError._DESTROY,
        KafkaError._FATAL,
        KafkaError._PURGE_QUEUE,
        KafkaError._PURGE_INFLIGHT,
        KafkaError._UNKNOWN_PARTITION,
        KafkaError._UNKNOWN_TOPIC,
        KafkaError._STATE,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError.NETWORK_EXCEPTION,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.BROKER_NOT_AVAILABLE,
        KafkaError.REPLICA_NOT_AVAILABLE,
        KafkaError.NOT_ENOUGH_REPLICAS,
        KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
        KafkaError.KAFKA_STORAGE_ERROR,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.CONCURRENT_TRANSACTIONS,
        KafkaError.THROTTLING_QUOTA_EXCEEDED,
    }
)


def failure_kind(error: KafkaError) -> FailureKind:
    """What a delivery error says about the record (see FailureKind). A topic that does not exist looks
    like a transport error here (unknown partition, timeout); ``_explain_missing_topics`` re-labels it."""
    code = error.code()
    if code in PERMANENT_ERRORS:
        return "permanent"
    if code in TRANSPORT_ERRORS or error.retriable():
        return "transport"
    return "record"
