"""`pocket-mlx chat`: the Textual app.

All MLX work (loading, generating, the KV cache) happens on one long-lived engine worker thread
(tui/jobs.py `ChatEngine`, started here from a Textual thread worker):
MLX streams belong to the thread that made them, so the model and its cache stay with one thread.
The UI sends it jobs through a queue and hears back only through messages (`events`).

A turn that gets no reply (refused because it cannot fit the model's context, failed, or stopped
before the first token) is undone: the saved conversation never keeps a prompt as if answered.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.containers import Horizontal
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer
from textual.worker import get_current_worker

from pocket_mlx.config import ModelFolder
from pocket_mlx.engine.conversations import Conversation, ConversationStore
from pocket_mlx.engine.devices import describe, gpu_available
from pocket_mlx.engine.drafters import DEFAULT_NUM_DRAFT_TOKENS
from pocket_mlx.engine.generation import GenerationStats
from pocket_mlx.engine.params import PROMPT_CACHE_MB
from pocket_mlx.engine.session import Settings
from pocket_mlx.errors import PocketError
from pocket_mlx.tui.commands import KEYS, help_keys, one_frame, system_commands
from pocket_mlx.tui.conversation import AssistantMessage, ConversationView, finish_notice
from pocket_mlx.tui.events import (
    ContextMeasured,
    ContextTrimmed,
    EngineNotice,
    ModelFailed,
    ModelReady,
    PrefillProgress,
    ReplyDone,
)
from pocket_mlx.tui.header import ModelHeader
from pocket_mlx.tui.jobs import ChatEngine, Job, LiveReply, Turn, undone_note
from pocket_mlx.tui.model_info import ModelInfo
from pocket_mlx.tui.prompt import PromptInput
from pocket_mlx.tui.saved import SavedChats
from pocket_mlx.tui.screens import HelpScreen, OpenScreen, SettingsScreen
from pocket_mlx.tui.stats_panel import REFRESH_S, StatsPanel
from pocket_mlx.tui.textual_private import QuietCrash
from pocket_mlx.tui.thinking import ThinkingSwitch, saved_reply, write_live

TICK_S = REFRESH_S  # 0.25 s, the UI's one timer: the stats panel redraws every tick (4 Hz: the
# speeds read as live, and a redraw of one line-API widget costs little next to a decode step)
TEXT_EVERY = 2  # ...and reply text is appended every 2nd tick (2 Hz): each Markdown append
# re-parses the last block and re-lays out the screen (once: see textual_private.SteadySize), the
# UI's costliest step. Everything the UI does during a reply happens in one tick, in one batch
# (`_tick`), so it costs one compositor pass, not one per source.
GIL_SWITCH_S = 0.001  # see on_mount


class ChatApp(QuietCrash, ThinkingSwitch, App[None]):
    CSS_PATH = "chat.tcss"
    TITLE = "pocket-mlx chat"
    BINDINGS = KEYS

    def __init__(self, model: str | None = None, *, device: str = "cpu",
                 settings: Settings | None = None, conversation: Conversation | None = None,
                 store: ConversationStore | None = None, model_name: str | None = None,
                 path: Path | ModelFolder | None = None, prompt_cache_mb: int = PROMPT_CACHE_MB,
                 distributed=None, speculative: str = "off",
                 num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS) -> None:
        super().__init__()
        # Set once the engine thread ended (under `chat --distributed`: the others were told).
        self.engine_done = threading.Event()
        self.model_ref = model  # as the user named it: saved with new conversations (--resume)
        # Its folder when the caller resolved it already (cli/chat.py): loaded as is, not
        # resolved (a hub lookup, a synthetic build) a second time.
        self.model_path = path
        self.model_name = model_name or (str(model).rstrip("/").split("/")[-1] if model
                                         else "pocket-tiny")
        self.device = device
        self.settings = settings or Settings()
        self.store = store or ConversationStore()
        self.info: ModelInfo | None = None
        self.ready = False
        self.busy = False
        self.last_stats: GenerationStats | None = None  # of the last finished reply
        self.replies_done = 0  # replies ended (finished, stopped or failed): tests wait on it
        self._stop = threading.Event()
        self._reply: AssistantMessage | None = None
        self._live = LiveReply()
        # The model's side, run by `engine` on a Textual thread worker. `prompt_cache_mb` and
        # `distributed` (rank 0's Lockstep, the other ranks following it), `speculative` and
        # `num_draft_tokens` (chat --speculative, --num-draft-tokens): see ChatEngine.
        self._model = ChatEngine(self.post_message, self._live, self._stop,
                                 model=path or model, device=device, model_name=self.model_name,
                                 prompt_cache_mb=prompt_cache_mb, distributed=distributed,
                                 speculative=speculative, num_draft_tokens=num_draft_tokens)
        self._ticks = 0
        self._reply_settings = self.settings
        self._turn: Turn | None = None
        self.saved = SavedChats(self.store, model)
        self.conversation = conversation or self.saved.new(self.settings)

    # ---- layout ----------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield ModelHeader(id="model-header")
        with Horizontal(id="main"):
            yield ConversationView(id="conversation")
            yield StatsPanel(id="stats")
        yield PromptInput(id="prompt")
        yield Footer()

    @property
    def view(self) -> ConversationView:
        return self.query_one(ConversationView)

    @property
    def stats_panel(self) -> StatsPanel:
        return self.query_one(StatsPanel)

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    async def on_mount(self) -> None:
        # The engine thread drops the GIL in every MLX eval and must get it back at once; with
        # the default 5 ms switch interval a busy UI thread can make it wait that long each time.
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, GIL_SWITCH_S))
        self.query_one(ModelHeader).show_loading(self.model_name)
        self.prompt.disabled = True
        self.stats_panel.show_host(self.device)
        await self._show_conversation()
        self._report_warnings(self.conversation)
        self.set_interval(TICK_S, self._tick)
        self.engine()
        self._measure()  # served once the model is loaded

    def on_unmount(self) -> None:
        sys.setswitchinterval(self._switch_interval)

    # ---- the engine thread -----------------------------------------------------------------
    @work(thread=True, exclusive=True, group="engine", name="engine", exit_on_error=True)
    def engine(self) -> None:
        """Load the model, then serve generation jobs until the app closes (tui/jobs.py)."""
        worker = get_current_worker()
        try:
            self._model.run(lambda: worker.is_cancelled)
        finally:
            self.engine_done.set()

    # ---- engine messages -------------------------------------------------------------------
    def on_model_ready(self, msg: ModelReady) -> None:
        self.info = msg.info
        self.ready = True
        self.query_one(ModelHeader).show_model(msg.info)
        panel = self.stats_panel
        panel.context_max = msg.info.context_max
        panel.bytes_per_token = msg.info.bytes_per_token
        panel.set_phase("idle")
        self.prompt.disabled = False
        self.prompt.focus()

    def on_model_failed(self, msg: ModelFailed) -> None:
        self.exit(return_code=2, message=f"pocket-mlx chat: error: {msg.error}")

    def on_engine_notice(self, msg: EngineNotice) -> None:
        self.notify(msg.text, severity="warning", timeout=10)

    def on_prefill_progress(self, msg: PrefillProgress) -> None:
        self.stats_panel.set_prefill(msg.done, msg.total, msg.context)

    async def on_context_trimmed(self, msg: ContextTrimmed) -> None:
        s = "s" if msg.dropped > 1 else ""
        await self.view.add_notice_before(
            f"■ dropped {msg.dropped} oldest message{s} from the model's context to fit "
            "(they stay saved)",
            self._reply)

    def on_context_measured(self, msg: ContextMeasured) -> None:
        if msg.conv_id == self.conversation.id and not self.busy:
            self.stats_panel.set_context(msg.tokens)

    async def _tick(self) -> None:
        """The UI's only periodic work: pull what the engine published, redraw the panel."""
        self._ticks += 1
        try:
            panel = self.stats_panel
        except NoMatches:  # the app is closing: its widgets are gone before its timer
            return
        reply = self._reply
        if reply is not None:
            stats, context = self._live.latest()
            if stats is not None and stats is not panel.stats:
                panel.set_stats(stats, context)
        # The panel's repaint and the reply's new text in one compositor pass (else the screen
        # updates once when the panel is repainted and again after the append).
        with one_frame(self):
            panel.redraw()
            if reply is not None and self._ticks % TEXT_EVERY == 0:
                await write_live(reply, self._live, stats)

    async def on_reply_done(self, msg: ReplyDone) -> None:
        reply, self._reply = self._reply, None
        with one_frame(self):  # last text, colours, notice, cursor: one layout
            try:
                if reply is not None:
                    await self._finish_reply(reply, msg)
            finally:
                self.busy = False
                self.prompt.cursor_blink = True
                self.replies_done += 1

    async def _finish_reply(self, reply: AssistantMessage, msg: ReplyDone) -> None:
        panel = self.stats_panel
        text = self._live.take_text() + msg.text  # what the ticks had not shown yet, in order
        await reply.think(self._live.take_reasoning() + msg.reasoning)
        self._live.reset()
        if text:
            await reply.write(text)
        await reply.finish()
        panel.set_phase("idle")
        if msg.error or msg.stats is None:
            await reply.discard()  # a failed turn is undone, partial text included
            turn = await self._undo_turn()
            if msg.refused:  # the text back in the prompt says the rest
                await self.view.add_notice(f"■ not sent: {msg.error}", "error")
            else:
                await self.view.add_notice(f"■ error: {msg.error}{undone_note(turn)}", "error")
                self.notify(msg.error or "generation failed", title="Generation failed",
                            severity="error")
            # the prompt box may have grown with the text put back: keep the notice in view
            self.call_after_refresh(self.view.scroll_end, animate=False)
            return
        panel.set_stats(msg.stats, msg.context)
        self.last_stats = msg.stats
        reason = msg.stats.finish_reason
        reply.show_thought(msg.stats.reasoning_s, msg.stats.reasoning_tokens, done=True)
        if reason == "cancelled" and not reply.text and not reply.reasoning:
            await reply.discard()
            turn = await self._undo_turn()
            await self.view.add_notice(f"■ stopped before the reply began{undone_note(turn)}")
            self.call_after_refresh(self.view.scroll_end, animate=False)
            return
        self._turn = None
        notice = finish_notice(reason, self._reply_settings.max_tokens)
        if notice:
            await self.view.add_notice(notice)
        self.conversation.messages.append(saved_reply(reply, msg.stats))
        self._save()

    # ---- conversation ----------------------------------------------------------------------
    def _save(self) -> None:
        if error := self.saved.save(self.conversation, self.settings):
            self.notify(error, severity="error")

    async def _undo_turn(self) -> Turn | None:
        """Take back the turn that got no reply: the prompt leaves the conversation (and the
        saved file) and goes back into the prompt box; a regenerated reply's predecessor
        returns. The panel then shows the conversation's context again."""
        turn, self._turn = self._turn, None
        if turn is None:
            return None
        msgs = self.conversation.messages
        if turn.kind == "send" and msgs and msgs[-1] is turn.message:
            msgs.pop()
            await self.view.remove_last_user()
            if not self.prompt.text.strip():
                self.prompt.text = turn.message["content"]
                self.prompt.move_cursor(self.prompt.document.end)
        elif turn.kind == "regenerate" and turn.previous is not None:
            msgs.append(turn.previous)
            await self._show_message(turn.previous)
        self._save()
        if error := self.saved.forget_if_empty(self.conversation):
            self.notify(error, severity="error")
        self._measure()
        return turn

    def _measure(self) -> None:
        """Ask the engine how many tokens the conversation on screen takes in the model's
        context (after resume, open or an undone turn), for the panel."""
        conv = self.conversation
        if conv.messages:
            self._model.put(Job(conv.chat_messages(), replace(self.settings), self.device,
                               kind="measure", conv_id=conv.id))
        else:
            self.stats_panel.set_context(0)

    def _report_warnings(self, conv: Conversation) -> None:
        for w in conv.warnings:
            self.notify(w, title=f"Conversation {conv.id}: fixed on load", severity="warning",
                        timeout=10)

    async def _show_conversation(self) -> None:
        """Render the whole conversation (after resume or open)."""
        await self.view.clear()
        for m in self.conversation.messages:
            await self._show_message(m)

    async def _show_message(self, m: dict) -> None:
        view = self.view
        if m["role"] == "user":
            await view.add_user(m["content"])
            self.prompt.remember(m["content"])
        elif m["role"] == "assistant":
            stats = m.get("stats") or {}  # checked at load (engine.conversations)
            device = describe(stats["device"]) if stats.get("device") else ""
            title = " · ".join(x for x in (self.model_name, device) if x)
            await view.add_assistant(m["content"], title, m.get("reasoning", ""), stats)
            notice = finish_notice(stats.get("finish_reason"), stats.get("generation_tokens"))
            if notice:
                await view.add_notice(notice)

    async def on_prompt_input_submitted(self, msg: PromptInput.Submitted) -> None:
        if not self.ready:
            self.notify("The model is still loading.", severity="warning")
            return
        if self.busy:
            self.notify("A reply is being written: wait, or press escape to stop it.",
                        severity="warning")
            return
        self.prompt.remember(msg.text)
        with one_frame(self):  # prompt cleared, two messages mounted: one layout
            self.prompt.text = ""
            message = {"role": "user", "content": msg.text}
            self.conversation.messages.append(message)
            self._turn = Turn("send", message)
            self._save()
            await self.view.add_user(msg.text)
            await self._start_reply()

    async def _start_reply(self) -> None:
        assert self.info is not None
        self._reply = await self.view.add_assistant(
            title=f"{self.model_name} · {describe(self.device)}")
        self._reply.start_stream()
        self._stop.clear()
        self._live.reset()
        self.busy = True
        self.prompt.cursor_blink = False  # a blinking cursor is 2 more redraws a second
        self._reply_settings = replace(self.settings)
        panel = self.stats_panel
        panel.device_label = describe(self.device)
        panel.set_phase("prefill")
        self._model.put(Job(self.conversation.chat_messages(), self._reply_settings, self.device))

    def _idle_or_warn(self) -> bool:
        if not self.ready:
            self.notify("The model is still loading.", severity="warning")
            return False
        if self.busy:
            self.notify("A reply is being written: press escape to stop it first.",
                        severity="warning")
            return False
        return True

    # ---- actions ---------------------------------------------------------------------------
    def action_stop(self) -> None:
        if self.busy:
            self._stop.set()

    def action_toggle_device(self) -> None:
        target = "cpu" if self.device == "gpu" else "gpu"
        if target == "gpu" and not gpu_available():
            self.notify("No GPU is available to MLX on this machine (CPU-only MLX build): "
                        "replies keep running on the CPU.", title="Device", severity="warning")
            return
        self.device = target
        self.stats_panel.device_label = describe(target)
        when = "the next reply" if self.busy else "replies"
        self.notify(f"{when.capitalize()} will run on the {describe(target)}.", title="Device")

    async def action_new_chat(self) -> None:
        if not self._idle_or_warn():
            return
        self.conversation = self.saved.new(self.settings)
        await self.view.clear()
        self.stats_panel.set_phase("idle")
        self.stats_panel.set_context(0)
        self.notify("New conversation.")

    async def action_regenerate(self) -> None:
        if not self._idle_or_warn():
            return
        msgs = self.conversation.messages
        previous = None
        if len(msgs) >= 2 and msgs[-1]["role"] == "assistant" and msgs[-2]["role"] == "user":
            previous = msgs.pop()
            await self.view.remove_last_reply()
        if not msgs or msgs[-1]["role"] != "user":
            self.notify("Nothing to regenerate yet.", severity="warning")
            return
        self._turn = Turn("regenerate", msgs[-1], previous)
        self._save()
        await self._start_reply()

    def action_open_chat(self) -> None:
        if not self._idle_or_warn():
            return
        convs, errors = self.store.list()
        for e in errors:
            self.notify(e, title="Corrupt conversation file skipped", severity="error",
                        timeout=10)
        self.push_screen(OpenScreen(convs), self._open_conversation)

    async def _open_conversation(self, conv_id: str | None) -> None:
        if not conv_id:
            return
        try:
            conv = self.store.load(conv_id)
        except PocketError as e:
            self.notify(str(e), severity="error")
            return
        self.conversation = conv
        if (settings := self.saved.settings_of(conv)) is not None:
            self.settings = settings
        else:
            self.notify("The saved settings are invalid; keeping the current ones.",
                        severity="warning")
        await self._show_conversation()
        self.stats_panel.set_context(0)  # until the engine has counted it
        self._measure()
        self.notify(f"Opened conversation {conv.id}.")
        self._report_warnings(conv)

    def action_settings(self) -> None:
        self.push_screen(SettingsScreen(self.settings), self._apply_settings)

    def _apply_settings(self, settings: Settings | None) -> None:
        if settings is None:
            return
        changed_system = settings.system != self.settings.system
        self.settings = settings
        self._save()
        extra = " The system prompt changed: the next reply re-reads the conversation." \
            if changed_system and self.conversation.messages else ""
        self.notify("Settings saved." + extra, title="Settings")

    def action_help(self) -> None:
        self.push_screen(HelpScreen(help_keys(self.BINDINGS)))

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield from system_commands(self)
