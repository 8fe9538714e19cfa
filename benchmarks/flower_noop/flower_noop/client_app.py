"""A ClientApp that answers every message at once; it imports neither torch nor fedloom,
so what a round costs with it is Flower's messaging and its process per message."""

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"reply": ConfigRecord({"ok": 1})}), reply_to=msg)
